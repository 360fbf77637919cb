"""Sharing the CPU with other processes: the OpenMP wait policy of the ``aiayn`` command.

torch's CPU wheel runs its parallel regions on GNU OpenMP (libgomp; MKL and oneDNN use the same
thread pool). Between two regions libgomp's worker threads *spin* (busy-wait) before they sleep:
about 300,000 polls when ``OMP_WAIT_POLICY`` is unset (libgomp's estimate: ~3 ms). Alone on the
machine that hides the wake-up latency of the next region. Beside another busy process it is a
disaster: the spinning threads of one process burn the cores the other's threads need to reach
their barrier, so both crawl (issue 34: the default ``aiayn train`` took 292 s beside a
beam-search ``aiayn translate`` on 2 cores, 11 s alone).

``OMP_WAIT_POLICY=PASSIVE`` makes a waiting thread sleep at once (futex), so two processes share
the cores as the kernel's scheduler intends. ``python -m benchmarks.shared_machine`` measures it
alone and shared against the old default (docs/robustness.md, "Sharing a machine").

The environment is read by the OpenMP runtime once, when torch's shared libraries load, so
``apply_command_defaults`` runs in ``aiayn/__init__.py`` before anything imports torch, and only in
the ``aiayn`` command itself (the console script, ``python -m aiayn``, ``python -m aiayn.cli``):
a Python program that imports aiayn as a library keeps its own process settings. A value the user
set is never overridden: ``OMP_WAIT_POLICY`` itself, or ``GOMP_SPINCOUNT`` (libgomp's own spin
count, which takes precedence over the policy; ``GOMP_SPINCOUNT=300000`` restores the old default
exactly). The variables set here are inherited by the command's child processes (torchrun ranks,
``aiayn experiment --jobs`` workers, a served engine), which is what they need too.

This module imports nothing but the standard library (it runs before torch may be imported).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import PurePath

WAIT_POLICY = "OMP_WAIT_POLICY"
# The user's own spin settings: any of these set means "the user chose", and we leave all alone.
# GOMP_SPINCOUNT is libgomp's (torch's Linux wheels); KMP_BLOCKTIME is Intel's and LLVM's libomp's
# (torch's macOS wheels), where OMP_WAIT_POLICY=PASSIVE means a block time of 0.
USER_SPIN_SETTINGS = (WAIT_POLICY, "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
DEFAULTS = {WAIT_POLICY: "PASSIVE"}
# The module names that run the command under ``python -m``.
COMMAND_MODULES = ("aiayn", "aiayn.cli", "aiayn.__main__", "aiayn.cli.__main__")


def is_the_aiayn_command(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """True when this process is the ``aiayn`` command: its script is named ``aiayn`` (the console
    script; under torchrun too), or Python was started with ``-m aiayn`` / ``-m aiayn.cli``.

    ``argv`` is ``sys.argv`` (while ``python -m`` imports the package, ``sys.argv[0]`` is still
    ``"-m"``), ``orig_argv`` is ``sys.orig_argv``, the interpreter's own command line."""
    if argv and PurePath(argv[0]).stem in ("aiayn", "aiayn-script"):  # aiayn, aiayn.exe, aiayn-script.py
        return True
    args = iter(orig_argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None) in COMMAND_MODULES
        if arg.startswith("-m"):  # -maiayn
            return arg[2:] in COMMAND_MODULES
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # options with a separate value
            next(args, None)
        elif arg == "-c" or not arg.startswith("-"):  # -c code or a script: not the command
            return False
    return False


def command_defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    """The variables ``apply_command_defaults`` would set in ``environ``: none when the user set
    any spin setting of their own (``USER_SPIN_SETTINGS``)."""
    if any(name in environ for name in USER_SPIN_SETTINGS):
        return {}
    return dict(DEFAULTS)


def apply_command_defaults(environ: MutableMapping[str, str] | None = None, *,
                           argv: Sequence[str] | None = None, orig_argv: Sequence[str] | None = None,
                           modules: MutableMapping[str, object] | None = None) -> dict[str, str]:
    """Set the command's OpenMP defaults in ``environ`` (``os.environ``) when this process is the
    ``aiayn`` command and torch is not loaded yet (after that the runtime has read its settings);
    returns what was set (empty when nothing was)."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", argv) if orig_argv is None else orig_argv
    modules = sys.modules if modules is None else modules
    if "torch" in modules or not is_the_aiayn_command(argv, orig_argv):
        return {}
    chosen = command_defaults(environ)
    environ.update(chosen)
    return chosen
