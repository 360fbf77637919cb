"""``aiayn explore``: a local web page to look inside a model (``aiayn.explore``)."""

from __future__ import annotations

from pathlib import Path

import click

from aiayn.cli.app import (
    DEFAULT_MODEL_HELP,
    bad_value,
    cli,
    device_option,
    model_options,
    one_model,
    place,
    threads_option,
)


@cli.command("explore")
@model_options("A run directory written by aiayn train (translation, shakespeare-char, any task).",
               "A shipped model (see `aiayn models`), a GGUF file or a Hugging Face model directory "
               f"(decoder-only or BERT-family). {DEFAULT_MODEL_HELP}")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but a loopback address serves the page to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--no-open", is_flag=True, help="Print the URL without opening a browser.")
@device_option
@threads_option
def explore_cmd(run_dir: Path | None, model_path: Path | None, host: str, port: int, no_open: bool,
                device: str = "auto", threads: int | None = None) -> None:
    """Look inside a model in the browser: attention (cross-attention too), decoding step by step
    with the KV cache, the beam-search tree, positional encodings, the training run.

    Every model runs on --device, a task run's too (its attention example follows the model)."""
    from aiayn.cli.generate import resolve_model
    from aiayn.explore import load_explorable
    from aiayn.explore.server import ServeError, check_port, serve

    where = place(device, threads)
    one_model(run_dir, model_path)
    model_path = resolve_model(run_dir, model_path)  # a shipped name, or SmolLM2 by default
    with bad_value("--port/--host", ServeError):
        if port:
            check_port(host, port)  # before loading the model: fail in a second, not after it
        explorable = load_explorable(run_dir, model_path, device=where)
        serve(explorable, host=host, port=port, open_browser=not no_open, echo=click.echo)
