"""The ``aiayn`` command line: parse arguments, call the library, print.

Every failure is one line on stderr, ``Error: what is wrong; what to do``, with no traceback unless
``AIAYN_DEBUG=1`` or ``--debug``; a warning is one line, ``warning: ...``. Exit codes: 2 for a usage error
(options, configs, run directories, model files: ``ConfigError``, ``RunDirError``, ``InteropError``, ...); 1
for a failure of the work itself (divergence, out of memory, I/O, an internal error); 130 when interrupted. A
closed output pipe ends quietly. The commands live in one module per subject; ``app`` holds the command group.
No module of the library imports this package."""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import click

from aiayn.cli import (  # noqa: F401  (registers the commands)
    data,
    experiments,
    explain,
    explore,
    finetune,
    generate,
    plots,
    serve,
    train,
    translate,
)
from aiayn.cli.app import cli, is_main_process
from aiayn.config import ConfigError

__all__ = ["cli", "main"]


def _debug(argv: list[str] | None) -> bool:
    """``AIAYN_DEBUG=1`` or ``--debug`` before the command: show tracebacks instead of one line."""
    args = sys.argv[1:] if argv is None else argv
    return os.environ.get("AIAYN_DEBUG", "") not in ("", "0") or "--debug" in args[:1]


# How long a rank > 0 of a torchrun job waits before saying its own error (seconds).
RANK_REPORT_GRACE_S = 5.0


def _fail(message: str, code: int) -> None:
    """Say ``Error: message`` once and exit. Under torchrun rank 0 says it at once and a rank > 0 first waits,
    so the job ends on rank 0's line; a rank > 0 still alive after the wait failed alone and says its own
    line, named."""
    if is_main_process():
        click.echo(f"Error: {message}", err=True)
    else:
        time.sleep(RANK_REPORT_GRACE_S)
        click.echo(f"Error (rank {os.environ.get('RANK')}): {message}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the command; every failure is one line on stderr (see the module doc)."""
    debug = _debug(argv)
    if not debug:  # a library warning is one line too: "warning: ...", not file:line and source
        warnings.showwarning = _one_line_warning
    try:
        code = cli.main(args=argv, prog_name="aiayn", standalone_mode=False)
    except click.ClickException as exc:  # bad arguments: click's message, without the usage block
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see '{exc.ctx.command_path} --help')"
        _fail(f"{exc.format_message()}{hint}", exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except (KeyboardInterrupt, click.exceptions.Exit) as exc:
        if isinstance(exc, click.exceptions.Exit):
            sys.exit(exc.exit_code)
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`| head`): nothing to say, nowhere to say it
        _quiet_stdout()
        sys.exit(1)
    except Exception as exc:
        if debug:
            raise
        message, status = _failure(exc)
        if status == 2 and getattr(exc, "reported", False):  # rank 0 said it before every rank stopped
            sys.exit(2)
        _fail(message, status)
    sys.exit(code if isinstance(code, int) else 0)


def _failure(exc: Exception) -> tuple[str, int]:
    """The line and exit code of a failure: 2 for problems a user can fix (nothing saved is touched), 1
    for the work failing, the last resort an internal error."""
    import torch

    from aiayn.data.parallel import DataError
    from aiayn.interop.mapping import InteropError
    from aiayn.tasks.base import UnknownTaskError
    from aiayn.train.checkpoint import CheckpointError
    from aiayn.train.distributed import DistributedError
    from aiayn.train.memory import TrainingOutOfMemory
    from aiayn.train.trainer import RunDirError, TrainingDiverged

    if isinstance(exc, ConfigError | UnknownTaskError | RunDirError | CheckpointError | InteropError
                  | DistributedError | DataError):
        return str(exc), 2
    if isinstance(exc, TrainingDiverged | TrainingOutOfMemory):  # training's OOM says what is kept and the fix
        return str(exc), 1
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return "out of memory: the model or batch does not fit; try a smaller model, batch or --max-new-tokens", 1
    if isinstance(exc, OSError):  # a file that cannot be read or written: name it
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or exc}{where}", 1
    return (f"internal error: {type(exc).__name__}: {exc} (run again with AIAYN_DEBUG=1 for the traceback; "
            f"please report it)", 1)


def _one_line_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    if is_main_process():
        click.echo(f"warning: {message}", err=True)


def _quiet_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so that Python's exit flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
