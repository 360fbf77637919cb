"""The aiayn command's OpenMP wait policy (aiayn/cpu_sharing.py, issue 34 point 6): which process
counts as the command, that a user's own setting wins, and, through real subprocesses, that the
policy reaches the OpenMP runtime (it is set before torch loads) for the command only.

The subprocess checks read libgomp's own account of its settings (``OMP_DISPLAY_ENV=VERBOSE``
prints them to stderr as the runtime starts, when torch's libraries load): the spin count it
will use, which is what the policy changes.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn import cpu_sharing
from aiayn.cpu_sharing import apply_command_defaults, command_defaults, is_the_aiayn_command

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.mark.parametrize(("argv", "orig_argv", "expected"), [
    (["/venv/bin/aiayn", "train"], ["/venv/bin/python3", "/venv/bin/aiayn", "train"], True),  # console script
    (["C:\\venv\\Scripts\\aiayn.exe", "train"], ["aiayn.exe", "train"], True),
    (["-m", "train"], ["python", "-m", "aiayn", "train"], True),  # python -m aiayn, while the package imports
    (["-m"], ["python", "-u", "-m", "aiayn.cli"], True),  # torchrun's workers: python -u -m ...
    (["-m"], ["python", "-X", "importtime", "-maiayn"], True),
    (["-m"], ["python", "-m", "aiayn.cli.__main__"], True),
    (["-m"], ["python", "-m", "pytest", "tests"], False),
    (["-m"], ["python", "-m", "benchmarks.shared_machine"], False),  # a program that imports aiayn
    (["-c"], ["python", "-c", "import aiayn"], False),
    (["train.py"], ["python", "train.py", "-m", "aiayn"], False),  # -m after the script is the script's
    (["/home/me/aiayn-notes.py"], ["python", "/home/me/aiayn-notes.py"], False),
    ([], [], False),
])
def test_which_process_is_the_command(argv, orig_argv, expected):
    assert is_the_aiayn_command(argv, orig_argv) is expected


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "passive"},
                                  {"GOMP_SPINCOUNT": "300000"}, {"KMP_BLOCKTIME": "200"}])
def test_a_users_own_spin_setting_wins(user):
    environ = dict(user)
    set_now = apply_command_defaults(environ, argv=["aiayn"], orig_argv=["python", "aiayn"], modules={})
    assert set_now == {} and environ == user


def test_the_command_sleeps_instead_of_spinning():
    environ = {"OMP_NUM_THREADS": "2"}
    set_now = apply_command_defaults(environ, argv=["aiayn"], orig_argv=["python", "aiayn"], modules={})
    assert set_now == {"OMP_WAIT_POLICY": "PASSIVE"} == command_defaults({})
    assert environ == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


def test_nothing_is_set_once_torch_is_loaded_or_outside_the_command():
    environ: dict[str, str] = {}
    assert apply_command_defaults(environ, argv=["aiayn"], orig_argv=["aiayn"], modules={"torch": object()}) == {}
    assert apply_command_defaults(environ, argv=["-c"], orig_argv=["python", "-c", "pass"], modules={}) == {}
    assert environ == {}


def test_the_module_imports_only_the_standard_library():
    """It runs first in aiayn/__init__.py, before torch may be imported."""
    tree = ast.parse(Path(cpu_sharing.__file__).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


# ---- end to end: what libgomp itself was told ----------------------------------------------------
def gomp_settings(stderr: str) -> dict[str, str]:
    """libgomp's OMP_WAIT_POLICY and GOMP_SPINCOUNT from its OMP_DISPLAY_ENV=VERBOSE report."""
    settings = {}
    for line in stderr.splitlines():  # "  GOMP_SPINCOUNT = '300000'"
        name, sep, value = line.strip().partition(" = ")
        if sep and name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            settings.setdefault(name, value.strip("'"))
    return settings


def run_all(commands: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, dict[str, str]]:
    """Each command (started together: each is mostly torch's import) under a clean environment
    plus its own variables -> the settings libgomp started with."""
    procs = {}
    for name, (command, user) in commands.items():
        env = {k: v for k, v in os.environ.items() if k not in cpu_sharing.USER_SPIN_SETTINGS}
        env.update(user, OMP_DISPLAY_ENV="VERBOSE")
        procs[name] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)
    results = {}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {stderr[-2000:]}"
        results[name] = gomp_settings(stderr)
    return results


def test_the_policy_reaches_the_openmp_runtime_of_the_command_only():
    script = Path(PY).parent / "aiayn"  # the console script, as installed
    command = [str(script)] if script.exists() else [PY, "-m", "aiayn"]
    found = run_all({
        "library": ([PY, "-c", "import aiayn, torch; torch.ones(2).sum()"], {}),
        "command": ([*command, "--help"], {}),
        "user ACTIVE": ([PY, "-m", "aiayn", "--help"], {"OMP_WAIT_POLICY": "ACTIVE"}),
        "user spin": ([PY, "-m", "aiayn.cli", "--help"], {"GOMP_SPINCOUNT": "300000"}),
    })
    if "GOMP_SPINCOUNT" not in found["library"]:
        pytest.skip("this torch build's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in its report)")
    assert found["library"]["GOMP_SPINCOUNT"] == "300000"  # a program importing aiayn keeps libgomp's default
    assert found["command"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}  # sleep at once
    # the user's own value wins: ACTIVE spins for libgomp's ~5 minutes; an explicit spin count stays
    assert found["user ACTIVE"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000000000"}
    assert found["user spin"]["GOMP_SPINCOUNT"] == "300000"
