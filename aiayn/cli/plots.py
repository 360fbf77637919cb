"""``aiayn plot ...`` (attention maps, positional encodings, LR schedules, loss curves) and ``aiayn demo``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from aiayn.cli.app import (
    SEED_RANGE,
    FiniteFloatRange,
    bad_value,
    cli,
    device_option,
    one_model,
    place,
    threads_option,
    use_threads,
)
from aiayn.train.task import ATTENTION_KINDS


@cli.group("plot")
def plot_group() -> None:
    """Write a PNG: attention maps, positional encodings, LR schedules, loss curves."""


def _out_option(default: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=default,
                        show_default=True, help="PNG file to write.")


@plot_group.command("attention")
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path),
              help="A run directory written by aiayn train.")
@click.option("--model", "model_name",
              help="A shipped model (see `aiayn models`, e.g. multi30k-en-de) or a release directory.")
@click.option("--input", "text", help="Input in the task's syntax (16 digits for reverse, a sentence "
              "for translation, a test-set number for set-anomaly); default: the first test example.")
@click.option("--kind", type=click.Choice(ATTENTION_KINDS),
              help="Which attention: encoder (self), decoder (self, causal) or cross (encoder-decoder). "
                   "Default: cross for encoder-decoder tasks, the model's self-attention otherwise.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG file to write (default: <run>/attention.png for the default kind, "
                   "<run>/attention-KIND.png for another; for --model, the same names here).")
@device_option
@threads_option
def plot_attention_cmd(run_dir: Path | None, model_name: str | None, text: str | None, kind: str | None,
                       out: Path | None, device: str, threads: int | None = None) -> None:
    """Attention maps of a trained run or shipped model: a grid of layers x heads, each with its
    colour scale."""
    from aiayn import viz
    from aiayn.tasks.runs import RunInputError
    from aiayn.tasks.trained import load_run_or_release, resolve_model, single_model

    one_model(run_dir, model_name, required=True)
    where = place(device, threads)
    with bad_value("--run" if run_dir is not None else "--model", RunInputError):
        path, note = single_model(run_dir if run_dir is not None else resolve_model(model_name or ""))
        if note is not None:  # a map is one model's: an ensemble shows its first member
            click.echo(note, err=True)
        run = load_run_or_release(path, prepare=False)
    run.model.to(where)
    if run.task.attention_needs_splits:
        run.task.prepare(run.train_config.seed)
    with bad_value("--kind"):
        kind = run.task.attention_kind(kind)
    with bad_value("--input"):
        example = run.task.attention_example(run.model, text, kind)
    assert example is not None  # every task with attention_kinds draws them
    name = f"attention-{kind}.png" if kind != run.task.attention_kinds[0] else "attention.png"
    # A shipped model's folder is part of the installed package: never write into it.
    default = run_dir / name if run_dir is not None else Path(name)
    click.echo(viz.plot_attention(example.weights, example.query_labels, example.key_labels,
                                  out or default, title=example.title))


def _pe_plot(name: str, plot: str, width: int, extent: tuple[str, int, str], out: str, text: str) -> None:
    """``aiayn plot NAME``: ``aiayn.viz.<plot>`` of the sinusoidal encoding at an even ``--d-model``,
    over ``extent`` (the option, its default, its help)."""
    flag, default, extent_help = extent

    def even(ctx: click.Context, param: click.Parameter, value: int) -> int:
        if value % 2:
            raise click.BadParameter(f"{value} is odd; sin/cos pairs need an even width")
        return value

    @plot_group.command(name, help=text)
    @click.option("--d-model", type=click.IntRange(min=2), default=width, show_default=True, help="Even width.",
                  callback=even)
    @click.option(flag, type=click.IntRange(min=1), default=default, show_default=True, help=extent_help)
    @_out_option(out)
    def command(out: Path, **sizes: int) -> None:
        from aiayn import viz

        click.echo(getattr(viz, plot)(out, **sizes))


_pe_plot("pe", "plot_positional_encoding", 48, ("--max-len", 96, "Positions."), "positional_encoding.png",
         "The sinusoidal positional encoding as a heatmap.")
_pe_plot("pe-dot", "plot_pe_dot_products", 128, ("--max-offset", 100, "Largest k."), "pe_dot_products.png",
         "PE(t)·PE(t+k) against k for several t: it depends only on k.")


@plot_group.command("lr")
@click.option("--d-model", type=click.IntRange(min=1), default=512, show_default=True,
              help="Model width (Noam scales by d_model^-0.5).")
@click.option("--warmups", default="2000,4000,8000", show_default=True,
              help="Comma-separated Noam warmup lengths.")
@click.option("--steps", type=click.IntRange(min=2), default=20000, show_default=True, help="Steps shown.")
@click.option("--cosine-peak", type=FiniteFloatRange(min=0, min_open=True), default=1e-3,
              show_default=True, help="Peak of the cosine-with-warmup curve.")
@_out_option("lr_schedules.png")
def plot_lr_cmd(d_model: int, warmups: str, steps: int, cosine_peak: float, out: Path) -> None:
    """Noam schedules with several warmups, and cosine with warmup."""
    from aiayn import viz
    from aiayn.train.optim import cosine_lr, noam_lr

    try:
        warmup_list = [int(w) for w in warmups.split(",")]
        assert all(w > 0 for w in warmup_list)
    except (ValueError, AssertionError):
        raise click.BadParameter(f"{warmups!r} must be positive integers separated by commas",
                                 param_hint="--warmups") from None
    schedules: dict[str, Callable[[int], float]] = {
        f"noam d={d_model} warmup={w}": (lambda s, w=w: noam_lr(s, d_model=d_model, warmup=w))
        for w in warmup_list
    }
    schedules[f"cosine peak={cosine_peak:g} warmup={warmup_list[0]}"] = (
        lambda s: cosine_lr(s, peak=cosine_peak, warmup=warmup_list[0], total=steps))
    click.echo(viz.plot_lr_schedules(schedules, steps, out))


@plot_group.command("loss")
@click.option("--run", "run_dirs", required=True, multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="A run directory written by aiayn train (or a release folder: its record's metrics); "
                   "repeat it to compare runs on one plot.")
@click.option("--label", "labels", multiple=True,
              help="A run's name on the plot, one per --run in order (default: the run folders' names).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG file to write (default: <run>/curves.png; several runs: runs.png here).")
def plot_loss_cmd(run_dirs: tuple[Path, ...], labels: tuple[str, ...], out: Path | None) -> None:
    """Training loss, validation NLL and learning rate of a run; of several runs (--run A --run B
    ...), their validation NLL and validation score (BLEU or accuracy) against the step, side by
    side."""
    from aiayn import viz

    if labels and len(labels) != len(run_dirs):
        raise click.BadParameter(f"{len(labels)} --label for {len(run_dirs)} --run; give one per --run, in order",
                                 param_hint="--label")
    names = list(labels) or [run_dir.name for run_dir in run_dirs]
    if len(set(names)) != len(names):  # folders of one name in different places: their paths tell them apart
        names = list(labels) or [str(run_dir) for run_dir in run_dirs]
    if len(set(names)) != len(names):
        raise click.BadParameter("two runs have one name; give each its own --label", param_hint="--label")
    runs = {}
    for name, run_dir in zip(names, run_dirs, strict=True):
        # a run's own metrics.csv, or a release's record of the run that made it (aiayn/pretrained/NAME)
        metrics = next((m for m in (run_dir / "metrics.csv", run_dir / "record" / "metrics.csv") if m.is_file()),
                       None)
        if metrics is None:
            raise click.BadParameter(f"{run_dir} has no metrics.csv; is it a run directory?", param_hint="--run")
        with bad_value("--run", viz.MetricsError):
            runs[name] = viz.read_metrics(metrics)
        if not runs[name]:
            raise click.BadParameter(f"{metrics} has no rows yet: a run writes one per logging interval",
                                     param_hint="--run")
    if len(run_dirs) == 1:
        click.echo(viz.plot_metrics(runs[names[0]], out or run_dirs[0] / "curves.png"))
    else:
        click.echo(viz.plot_runs(runs, out or Path("runs.png")))


@cli.command("demo")
@click.option("--seed", type=SEED_RANGE, default=0, show_default=True, help="Random seed for the weights.")
@threads_option
def demo_cmd(seed: int, threads: int | None = None) -> None:
    """Build each model family and show cached decoding equals recomputation."""
    from aiayn.demo import run_demo

    use_threads(threads)
    if not run_demo(click.echo, seed=seed):
        raise SystemExit(1)
