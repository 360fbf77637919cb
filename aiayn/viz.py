"""Seeing inside: attention maps, positional encodings, learning-rate schedules, loss curves; each
function writes a PNG (matplotlib, no display needed) and returns its path."""

from __future__ import annotations

import csv
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import Tensor

from aiayn.nn.positional import sinusoidal_encoding

PANEL_INCHES = 3.2  # one attention heatmap with its colour bar
MIN_WIDTH_INCHES = 5.0  # room for a title even on a 1 x 1 grid


def save_figure(fig: plt.Figure, path: Path | str) -> Path:
    """Write ``fig`` as a PNG (its folder made) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def attention_figure(weights: Sequence[Tensor], query_labels: Sequence[str], key_labels: Sequence[str], *,
                     title: str = "attention") -> plt.Figure:
    """A grid of heatmaps, one row per layer and one column per head, each with its own colour bar
    (a fixed 0-1 scale would flatten a diffuse head); weights: per layer, (h, t_q, t_k) of one example."""
    n_layers, n_heads = len(weights), weights[0].shape[0]
    width = max(PANEL_INCHES * n_heads + 0.4, MIN_WIDTH_INCHES)
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(width, PANEL_INCHES * n_layers + 0.9),
                             squeeze=False, layout="constrained")
    for layer, layer_weights in enumerate(weights):
        for head in range(n_heads):
            ax = axes[layer][head]
            panel = layer_weights[head].detach().float().cpu().numpy()
            image = ax.imshow(panel, vmin=0.0, vmax=max(float(panel.max()), 1e-9), cmap="viridis")
            fig.colorbar(image, ax=ax, shrink=0.8)
            ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=9)
            ax.set_xticks(range(len(key_labels)), key_labels, fontsize=6, rotation=90)
            ax.set_yticks(range(len(query_labels)), query_labels, fontsize=6)
            ax.set_xlabel("key", fontsize=8)
            ax.set_ylabel("query", fontsize=8)
    # About 0.11 inch per character at font size 12: wrap so that the title never runs off the figure.
    fig.suptitle("\n".join(textwrap.wrap(title, max(20, int(width / 0.11)))), fontsize=12)
    return fig


def plot_attention(weights: Sequence[Tensor], query_labels: Sequence[str], key_labels: Sequence[str],
                   path: Path | str, *, title: str = "attention") -> Path:
    """``attention_figure`` written to ``path``."""
    return save_figure(attention_figure(weights, query_labels, key_labels, title=title), path)


def plot_positional_encoding(path: Path | str, *, d_model: int = 48, max_len: int = 96) -> Path:
    """The sinusoidal encoding as a heatmap (positions x dimensions), as in the UvA tutorial."""
    pe = sinusoidal_encoding(torch.arange(max_len), d_model)  # (max_len, d)
    fig, ax = plt.subplots(figsize=(9, 4))
    image = ax.imshow(pe.T.numpy(), aspect="auto", cmap="RdGy", vmin=-1, vmax=1, origin="lower")
    ax.set(xlabel="position", ylabel="dimension", title=f"sinusoidal positional encoding (d_model={d_model})")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_pe_dot_products(path: Path | str, *, d_model: int = 128, max_offset: int = 100,
                         starts: Sequence[int] = (0, 50, 200)) -> Path:
    """PE(t)·PE(t+k) against k for several t: the curves coincide (it depends only on k)."""
    positions = torch.arange(max(starts) + max_offset + 1)
    pe = sinusoidal_encoding(positions, d_model)
    fig, ax = plt.subplots(figsize=(7, 4))
    offsets = torch.arange(max_offset + 1)
    for t in starts:
        dots = (pe[t] * pe[t + offsets]).sum(-1)
        ax.plot(offsets.numpy(), dots.numpy(), label=f"t = {t}", linestyle="-" if t == starts[0] else "--")
    ax.set(xlabel="offset k", ylabel="PE(t) · PE(t + k)",
           title="the dot product of sinusoidal encodings depends only on the offset")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def plot_lr_schedules(schedules: dict[str, Callable[[int], float]], total_steps: int, path: Path | str) -> Path:
    """Each named schedule (step -> lr) over steps 1..total_steps."""
    steps = list(range(1, total_steps + 1))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, fn in schedules.items():
        ax.plot(steps, [fn(s) for s in steps], label=name)
    ax.set(xlabel="step", ylabel="learning rate", title="learning-rate schedules")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


class MetricsError(ValueError):
    """A metrics.csv that cannot be read as numbers (corrupt, foreign, or not written yet)."""


def read_metrics(csv_path: Path | str) -> list[dict[str, float]]:
    """The rows of a run's metrics.csv that have a step, each {column: value} of its filled cells; a
    file that is not UTF-8 CSV of numbers under a header with a ``step`` column is a ``MetricsError``."""
    try:
        with open(csv_path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None or "step" not in reader.fieldnames:
                raise MetricsError(f"{csv_path} has no header with a step column; is it a metrics.csv of aiayn train?")
            rows = []
            for row in reader:
                try:
                    rows.append({k: float(v) for k, v in row.items() if k is not None and v not in ("", None)})
                except (TypeError, ValueError):
                    raise MetricsError(f"{csv_path}, line {reader.line_num}: a value is not a number; the file is "
                                       f"damaged") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise MetricsError(f"{csv_path} is not a CSV file ({exc.__class__.__name__}); is it a metrics.csv "
                           f"of aiayn train?") from None
    return [row for row in rows if "step" in row]


def _loss_axis(ax: plt.Axes, title: str, **legend: object) -> None:
    """The loss panel's log scale, labels and title; a legend only when a line has a label."""
    ax.set(yscale="log", xlabel="step", ylabel="loss (nats/token)", title=title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**legend)


def _plot(ax: plt.Axes, rows: list[dict[str, float]], column: str, *fmt: str, of: str = "",
          **style: object) -> None:
    """``column`` against the step, of the rows that have ``of`` (default: ``column``); none: no line."""
    kept = [r for r in rows if (of or column) in r]
    if kept:
        ax.plot([r["step"] for r in kept], [r[column] for r in kept], *fmt, **style)


def plot_metrics(metrics: Path | str | list[dict[str, float]], path: Path | str) -> Path:
    """Training loss, validation NLL and learning rate of a run, from its metrics.csv (a path, or its rows)."""
    rows = metrics if isinstance(metrics, list) else read_metrics(metrics)
    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    _plot(ax_loss, rows, "train_loss", label="train loss")
    _plot(ax_loss, rows, "val_nll", "o-", label="val NLL")
    _loss_axis(ax_loss, "loss")
    _plot(ax_lr, rows, "lr", of="train_loss", color="tab:green")
    ax_lr.set(xlabel="step", ylabel="learning rate", title="learning rate")
    fig.tight_layout()
    return save_figure(fig, path)


# The per-run score a comparison plots beside the loss, the first a run has: translation BLEU, else accuracy.
SCORE_COLUMNS = (("val_bleu", "val BLEU (greedy)"), ("val_acc", "val accuracy"))


def plot_runs(runs: dict[str, list[dict[str, float]]], path: Path | str) -> Path:
    """Several runs side by side, from their metrics.csv rows ({label: rows}): validation NLL (each
    run's training loss faint behind it) and, where logged, a validation score against the step."""
    column, label = next(((c, name) for c, name in SCORE_COLUMNS
                          if any(c in r for rows in runs.values() for r in rows)), (None, None))
    fig, axes = plt.subplots(1, 2 if column else 1, figsize=(11 if column else 6, 4), squeeze=False)
    ax_loss = axes[0][0]
    for i, (name, rows) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        _plot(ax_loss, rows, "train_loss", color=colour, alpha=0.25)
        _plot(ax_loss, rows, "val_nll", "o-", color=colour, markersize=3, label=name)
        if column:
            scored = [r for r in rows if column in r]
            axes[0][1].plot([r["step"] for r in scored], [r[column] for r in scored], "o-", color=colour,
                            markersize=3, label=name)
    _loss_axis(ax_loss, "val NLL (lines), train loss (faint)", fontsize="small")
    if column:
        axes[0][1].set(xlabel="step", ylabel=label, title=label)
        axes[0][1].legend(fontsize="small")
    fig.tight_layout()
    return save_figure(fig, path)
