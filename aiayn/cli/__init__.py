"""The ``aiayn`` command line: one module per subject of commands, ``app`` holds the group.

Every failure is one line on stderr, ``Error: what is wrong; what to do`` (a traceback only with
``AIAYN_DEBUG=1`` or ``--debug``); a warning is ``warning: ...``. Exit codes: 2 for a usage error
(options, configs, run directories, model files), 1 for the work failing, 130 when interrupted."""

from __future__ import annotations

import contextlib
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


# How long a rank > 0 of a torchrun job waits before saying its own error (seconds).
RANK_REPORT_GRACE_S = 5.0


def _fail(message: str, code: int) -> None:
    """Say ``Error: message`` and exit. Under torchrun a rank > 0 first waits, so that the job ends on
    rank 0's line; one still alive after the wait failed alone and says its own line."""
    if is_main_process():
        click.echo(f"Error: {message}", err=True)
    else:
        time.sleep(RANK_REPORT_GRACE_S)
        click.echo(f"Error (rank {os.environ.get('RANK')}): {message}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the command; every failure is one line on stderr (see the module doc)."""
    args = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("AIAYN_DEBUG", "") not in ("", "0") or "--debug" in args[:1]  # tracebacks
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
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`| head`): stdout to /dev/null, so that exit's flush is quiet
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
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
    """The line and exit code of a failure: 2 for problems a user can fix, 1 for the work failing."""
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
