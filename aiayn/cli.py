"""The ``aiayn`` command line: parse arguments, build a config, call the library.

Errors a user can fix are reported as one line and exit code 2 (click's usage-error convention).
"""

from __future__ import annotations

import sys

import click

from aiayn import __version__
from aiayn.config import ConfigError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="aiayn")
def cli() -> None:
    """aiayn: Attention Is All You Need, complete — the Transformer family in PyTorch."""


@cli.command("kv-cache")
@click.option("--preset", help="Take the model sizes from a named preset (see `aiayn presets`).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences decoded at once.")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens held per sequence (prompt + generated). Default: the preset's max_seq_len.")
@click.option("--n-layers", type=click.IntRange(min=1), help="Decoder layers (each caches its own k and v).")
@click.option("--n-heads", type=click.IntRange(min=1), help="Query heads.")
@click.option("--n-kv-heads", type=click.IntRange(min=1), help="Key/value heads (GQA/MQA); default n-heads.")
@click.option("--d-model", type=click.IntRange(min=1), help="Model width; head_dim = d_model / n_heads.")
@click.option("--head-dim", type=click.IntRange(min=1), help="Per-head width, if not d_model / n_heads.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16", "int8"]),
              default="float32", show_default=True, help="Element type of the cache.")
def kv_cache_cmd(preset: str | None, batch_size: int, seq_len: int | None, n_layers: int | None,
                 n_heads: int | None, n_kv_heads: int | None, d_model: int | None,
                 head_dim: int | None, dtype: str) -> None:
    """Estimate KV-cache memory: 2 x layers x kv_heads x head_dim x seq_len x batch x bytes.

    Example (the seeds'): aiayn kv-cache --batch-size 32 --n-layers 32 --n-heads 32
    --d-model 4096 --seq-len 2048  ->  64 GiB
    """
    from aiayn.nn.kv_cache import format_bytes, kv_cache_bytes

    if preset is not None:
        from aiayn.models.presets import get_preset

        try:
            cfg = get_preset(preset)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--preset") from None
        n_layers = n_layers or (cfg.decoder_layers if cfg.arch != "encoder-only" else cfg.n_layers)
        n_heads = n_heads or cfg.n_heads
        n_kv_heads = n_kv_heads or cfg.n_kv_heads
        d_model = d_model or cfg.d_model
        head_dim = head_dim or cfg.head_dim
        seq_len = seq_len or cfg.max_seq_len
    missing = [name for name, value in (("--n-layers", n_layers), ("--n-heads", n_heads),
                                        ("--seq-len", seq_len)) if value is None]
    if d_model is None and head_dim is None:
        missing.append("--d-model (or --head-dim)")
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)}; give them or a --preset")
    assert n_layers is not None and n_heads is not None and seq_len is not None
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if n_heads % n_kv_heads != 0:
        raise click.BadParameter(f"{n_kv_heads} does not divide --n-heads {n_heads}",
                                 param_hint="--n-kv-heads")
    if head_dim is None:
        assert d_model is not None
        if d_model % n_heads != 0:
            raise click.BadParameter(f"{d_model} is not divisible by --n-heads {n_heads}; "
                                     f"give --head-dim instead", param_hint="--d-model")
        head_dim = d_model // n_heads
    total = kv_cache_bytes(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim,
                           seq_len=seq_len, batch_size=batch_size, dtype=dtype)
    click.echo(f"KV cache: {format_bytes(total)} ({total:,} bytes)")
    click.echo(f"  = 2 (k, v) x {n_layers} layers x {n_kv_heads} kv heads x {head_dim} head_dim "
               f"x {seq_len} tokens x {batch_size} batch x {total // (2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size)} bytes ({dtype})")
    if n_kv_heads != n_heads:
        full = total * n_heads // n_kv_heads
        click.echo(f"  multi-head attention with {n_heads} kv heads would need {format_bytes(full)}")


@cli.command("demo")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed for the weights.")
def demo_cmd(seed: int) -> None:
    """Build each model family and show cached decoding equals recomputation."""
    from aiayn.demo import run_demo

    if not run_demo(click.echo, seed=seed):
        raise SystemExit(1)


@cli.command("presets")
def presets_cmd() -> None:
    """List the named model configurations and their parameter counts."""
    from aiayn.models import build_model, count_parameters, get_preset, preset_names

    for name in preset_names():
        cfg = get_preset(name)
        n = count_parameters(build_model(cfg))
        click.echo(f"{name:12s} {cfg.arch:16s} d_model={cfg.d_model:<5d} layers={cfg.n_layers:<3d} "
                   f"heads={cfg.n_heads:<3d} d_ff={cfg.d_ff:<5d} vocab={cfg.vocab_size:<6d} params={n:,}")


def main() -> None:
    try:
        cli.main(prog_name="aiayn", standalone_mode=True)
    except ConfigError as exc:  # a config a user wrote that cannot work
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
