"""The ``aiayn`` command line: parse arguments, call the library, print.

Errors a user can fix are reported as one line and exit code 2 (click's usage-error convention).
The commands live by subject: ``train`` (train, tasks, average, presets, kv-cache), ``generate``
(generate, embed), ``translate`` (translate, evaluate, fetch-multi30k), ``plots`` (plot ..., demo);
``app`` holds the command group. No module of the library imports this package.
"""

from __future__ import annotations

import sys

import click

from aiayn.cli import generate, plots, train, translate  # noqa: F401  (registers the commands)
from aiayn.cli.app import cli, is_main_process
from aiayn.config import ConfigError

__all__ = ["cli", "main"]


def main(argv: list[str] | None = None) -> None:
    """Entry point: every error a user can fix is one line on stderr and exit code 2."""
    from aiayn.data.parallel import DataError
    from aiayn.interop.mapping import InteropError
    from aiayn.tasks.base import UnknownTaskError
    from aiayn.train.checkpoint import CheckpointError
    from aiayn.train.distributed import DistributedError
    from aiayn.train.trainer import RunDirError

    try:
        code = cli.main(args=argv, prog_name="aiayn", standalone_mode=False)
    except click.ClickException as exc:  # bad arguments: click's message, without the usage block
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see '{exc.ctx.command_path} --help')"
        click.echo(f"Error: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except (ConfigError, UnknownTaskError, RunDirError, CheckpointError, InteropError,
            DistributedError, DataError) as exc:
        # Problems a user can fix: one line, exit code 2, nothing saved is touched.
        if is_main_process():  # under torchrun every rank fails alike; rank 0 says it once
            click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
