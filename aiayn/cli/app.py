"""The ``aiayn`` command group and what its commands share."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from aiayn import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="aiayn")
@click.option("--debug", is_flag=True,
              help="Show the traceback of a failure instead of one line (or set AIAYN_DEBUG=1).")
def cli(debug: bool) -> None:
    """aiayn: Attention Is All You Need, complete — the Transformer family in PyTorch."""
    # Read by aiayn.cli.main from the arguments before the command runs (it decides how errors end).


def plain_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--plain``: the plain PyTorch model (a keyword ``plain`` of the command)."""
    return click.option("--plain", is_flag=True,
                        help="Run the plain PyTorch model, without aiayn.fast's CPU kernels.")(func)


def is_main_process() -> bool:
    """False on the ranks > 0 of a torchrun job (they train but print nothing)."""
    return os.environ.get("RANK", "0") == "0"


def check_threads(threads: int) -> int:
    """``--threads``: at most 4 per CPU of this machine (more only oversubscribes the cores, and
    torch fails outright on absurd counts), else a usage error that says the limit."""
    limit = 4 * (os.cpu_count() or 1)
    if threads > limit:
        raise click.BadParameter(f"{threads} threads is more than 4 per CPU of this machine "
                                 f"({os.cpu_count()} CPUs); give at most {limit}", param_hint="--threads")
    return threads
