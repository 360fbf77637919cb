"""The ``aiayn`` command group and what its commands share."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from aiayn import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="aiayn")
def cli() -> None:
    """aiayn: Attention Is All You Need, complete — the Transformer family in PyTorch."""


def plain_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--plain``: the plain PyTorch model (a keyword ``plain`` of the command)."""
    return click.option("--plain", is_flag=True,
                        help="Run the plain PyTorch model, without aiayn.fast's CPU kernels.")(func)


def is_main_process() -> bool:
    """False on the ranks > 0 of a torchrun job (they train but print nothing)."""
    return os.environ.get("RANK", "0") == "0"
