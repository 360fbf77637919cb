"""The paper's Table 1, measured: per-layer cost (FlopCounterMode; a formula for the RNN), time and path
length of self-attention, restricted self-attention, a recurrent layer and a convolution."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from aiayn.explain.base import Report, Table, timed
from aiayn.nn.attention import scaled_dot_product_attention
from aiayn.nn.local_attention import local_attention
from aiayn.viz import save_figure

TITLE = "Table 1, measured: self-attention, restricted attention, recurrent, convolutional layers"
QUESTION = "per-layer cost, sequential operations and path length, timed across n and d; where n > d"

KERNEL = 3  # convolution width k
LAYERS = ("self-attention", "restricted", "recurrent", "convolution")


def make_layer(kind: str, d: int, radius: int) -> Callable[[Tensor], Tensor]:
    """x (b, n, d) -> (b, n, d) for one layer of ``kind`` (random weights)."""
    if kind == "self-attention":
        return lambda x: scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])[0][:, 0]
    if kind == "restricted":
        return lambda x: local_attention(x[:, None], x[:, None], x[:, None], radius=radius)[:, 0]
    if kind == "recurrent":
        rnn = nn.RNN(d, d, batch_first=True)
        return lambda x: rnn(x)[0]
    conv = nn.Conv1d(d, d, KERNEL, padding=KERNEL // 2)
    return lambda x: conv(x.transpose(1, 2)).transpose(1, 2)


def flops(kind: str, n: int, d: int, radius: int) -> int:
    """FLOPs of one layer's forward, batch 1: counted by FlopCounterMode (the RNN: 2 products of d x d per step)."""
    if kind == "recurrent":
        return n * 2 * (2 * d * d)  # x_t W_ih and h_{t-1} W_hh, each 2 d² per step
    x = torch.randn(1, n, d)
    layer = (lambda x: scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], need_weights=True)[0]
             ) if kind == "self-attention" else make_layer(kind, d, radius)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(x)
    return counter.get_total_flops()


def path_length(kind: str, n: int, radius: int, *, dilated: bool = False) -> int:
    """The fewest stacked layers through which output n−1 depends on input 0 (for the RNN, its steps)."""
    if kind == "recurrent":
        return n - 1  # h_{n-1} = tanh(W x_{n-1} + U h_{n-2}): n−1 applications of U back to x_0
    torch.manual_seed(0)
    d = 4
    layers: list[Callable[[Tensor], Tensor]] = []
    for depth in range(1, n + 1):
        if kind == "convolution" and dilated:  # dilations 1, k, k², ... below n, then again (WaveNet)
            levels = max(1, math.ceil(math.log(n, KERNEL)))
            dilation = KERNEL ** ((depth - 1) % levels)
            conv = nn.Conv1d(d, d, KERNEL, padding=dilation, dilation=dilation)
            layers.append(lambda x, conv=conv: conv(x.transpose(1, 2)).transpose(1, 2))
        else:
            layers.append(make_layer(kind, d, radius))
        x = torch.randn(1, n, d, requires_grad=True)
        y = x
        for layer in layers:
            y = layer(y)
        (grad,) = torch.autograd.grad(y[0, n - 1].sum(), x)
        if grad[0, 0].abs().sum() > 0:
            return depth
    raise AssertionError("unreachable: n layers always connect the ends")


def run(out_dir: Path, *, quick: bool = False) -> Report:
    radius = 4 if quick else 16
    lengths = [16, 64, 256] if quick else [32, 64, 128, 256, 512, 1024, 2048]
    widths = [32, 128] if quick else [64, 256, 1024]
    timings = _timings(lengths, widths, radius)
    counted = {(kind, n, d): flops(kind, n, d, radius) for kind in LAYERS for n in lengths for d in widths}
    n_path = 16 if quick else 64
    paths = {kind: path_length(kind, n_path, radius) for kind in LAYERS}
    paths["dilated convolution"] = path_length("convolution", n_path, radius, dilated=True)
    summary = _summary(timings, counted, paths, radius, lengths, widths, n_path)
    grid, cross_table, crossover = _grids(timings, counted, lengths, widths)
    plot = out_dir / "table1.png"
    _plot(timings, counted, lengths, widths, plot)
    claims = {"timings": timings, "flops": counted, "paths": paths, "crossover": crossover, "radius": radius,
              "lengths": lengths, "widths": widths}
    return Report(TITLE, [summary, cross_table, grid], claims, [plot], _text(claims, n_path))


def _timings(lengths: list[int], widths: list[int], radius: int) -> dict[tuple[str, int, int], float]:
    """(layer type, n, d) -> ms of one forward of batch 1."""
    timings: dict[tuple[str, int, int], float] = {}
    for d in widths:
        for n in lengths:
            x = torch.randn(1, n, d)
            for kind in LAYERS:
                layer = make_layer(kind, d, radius)
                with torch.no_grad():
                    timings[kind, n, d] = 1e3 * timed(lambda layer=layer, x=x: layer(x), repeat=5, warmup=2)
    return timings


def _summary(timings: dict[tuple[str, int, int], float], counted: dict[tuple[str, int, int], float],
             paths: dict[str, int], radius: int, lengths: list[int], widths: list[int], n_path: int) -> Table:
    paper = {"self-attention": ("O(n² · d)", "O(1)", "O(1)"),
             "restricted": (f"O(r · n · d), r = {radius}", "O(1)", "O(n / r)"),
             "recurrent": ("O(n · d²)", "O(n)", "O(n)"),
             "convolution": (f"O(k · n · d²), k = {KERNEL}", "O(1)", "O(log_k n) dilated, O(n / k) contiguous")}
    n_mid, d_mid = lengths[len(lengths) // 2], widths[len(widths) // 2]
    summary = Table(f"Table 1 with measurements (FLOPs and ms at n = {n_mid}, d = {d_mid}; path length at "
                    f"n = {n_path})",
                    ["layer type", "complexity per layer (paper)", "FLOPs", "ms", "sequential operations (paper)",
                     "maximum path length (paper)", "measured path length (layers)"])
    for kind in LAYERS:
        measured = str(paths[kind]) if kind != "recurrent" else f"1 layer, {paths[kind]} steps"
        if kind == "convolution":
            measured += f" contiguous, {paths['dilated convolution']} dilated"
        summary.rows.append([kind, paper[kind][0], counted[kind, n_mid, d_mid], timings[kind, n_mid, d_mid],
                             "n" if kind == "recurrent" else "1", paper[kind][2], measured])
    return summary


def _grids(timings: dict[tuple[str, int, int], float], counted: dict[tuple[str, int, int], float],
           lengths: list[int], widths: list[int]) -> tuple[Table, Table, list[dict[str, Any]]]:
    """The time and FLOPs grid over n and d, and where attention becomes the costlier layer."""
    grid = Table("Time per layer (ms, forward, batch 1) and FLOPs, across n and d",
                 ["d", "n", *[f"{k} ms" for k in LAYERS], "attention ÷ recurrent FLOPs", "attention ÷ recurrent time"])
    for d in widths:
        for n in lengths:
            grid.rows.append([d, n, *[timings[k, n, d] for k in LAYERS],
                              counted["self-attention", n, d] / counted["recurrent", n, d],
                              timings["self-attention", n, d] / timings["recurrent", n, d]])
    crossover = []
    for d in widths:
        n0 = lengths[0]  # attention/recurrent FLOPs = n / d exactly: they are equal at n = d
        equal = n0 * counted["recurrent", n0, d] / counted["self-attention", n0, d]
        crossover.append({"d": d, "flops_equal": equal,
                          "time": _stays_above(lengths, lambda n, d=d: timings["self-attention", n, d] /
                                               timings["recurrent", n, d]),
                          "restricted_time": _stays_above(lengths, lambda n, d=d: timings["self-attention", n, d] /
                                                          timings["restricted", n, d])})
    cross_table = Table("Where self-attention becomes the costlier layer",
                        ["d", "FLOPs of attention = recurrent at n =", "time: attention > recurrent from n =",
                         "time: attention > restricted from n ="],
                        [[c["d"], c["flops_equal"], _n(c["time"]), _n(c["restricted_time"])] for c in crossover])
    return grid, cross_table, crossover


def _text(claims: dict[str, Any], n_path: int) -> str:
    crossover, lengths, radius, paths = claims["crossover"], claims["lengths"], claims["radius"], claims["paths"]
    d_big = claims["widths"][-1]
    time_cross = "; ".join(f"from n = {c['time']} on at d = {c['d']}" if c["time"] else f"nowhere in the grid at d = {c['d']}"
                           for c in crossover)
    cross_big = crossover[-1]
    return f"""
**Question.** Table 1 of the paper compares layer types on three counts. They are complexity per
layer, sequential operations (what cannot run in parallel) and maximum path length (how many steps a
signal needs between two positions). Self-attention is O(n² d) against the recurrent layer's
O(n d²). So it is cheaper "when the sequence length n is smaller than the representation
dimensionality d". Measured.

**FLOPs** follow the formulas exactly. FlopCounterMode counts attention 4n²d, restricted 4n(2r+1)d,
convolution 2knd² and recurrent 4nd². So attention's FLOPs pass the recurrent layer's exactly when n
exceeds d. Their measured ratio puts the crossing at n = {', '.join(f"{c['flops_equal']:g}" for c in crossover)}
for d = {', '.join(str(c['d']) for c in crossover)}.

**Time** is another story on a CPU. The recurrent layer's n sequential steps are n small
matrix-vector products that cannot run in parallel. Attention is two large matrix products.
Attention's time stays above the RNN's {time_cross} (grid: n up to {lengths[-1]}).
That is far beyond n = d. The "sequential operations" column, O(n) against O(1), is worth more than
the FLOP count suggests. Restricted attention (r = {radius}) grows linearly in n. It is cheaper than
full attention from n = {_n(cross_big['restricted_time'])} on at d = {d_big}.

**Path length** is measured by gradients: the fewest stacked layers through which output n−1
depends on input 0, at n = {n_path}. The counts:

* self-attention: {paths['self-attention']};
* restricted attention (r = {radius}): {paths['restricted']} = ⌈(n−1)/r⌉;
* a contiguous convolution (k = {KERNEL}): {paths['convolution']} layers;
* a dilated convolution (dilations 1, 3, 9, … repeated): {paths['dilated convolution']}, that is
  O(log_k n), with log_3 {n_path} = {math.log(n_path, KERNEL):.1f};
* the recurrent layer: one layer, but {paths['recurrent']} sequential steps.

Short paths make long-range dependencies easier to learn (section 4). Timings move between runs: read
the shapes of the curves, not the milliseconds.
"""


def _stays_above(lengths: list[int], ratio: Callable[[int], float]) -> int | None:
    """The smallest n from which ``ratio(n)`` > 1 for every larger n of the grid."""
    above = [n for i, n in enumerate(lengths) if all(ratio(m) > 1 for m in lengths[i:])]
    return above[0] if above else None


def _n(value: int | None) -> str:
    return "beyond the grid" if value is None else str(value)


def _plot(timings: dict, counted: dict, lengths: list[int], widths: list[int], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 4.2), layout="constrained", squeeze=False)
    for ax, d in zip(axes[0], widths, strict=True):
        for kind in LAYERS:
            ax.loglog(lengths, [timings[kind, n, d] for n in lengths], "o-", label=kind)
        ax.axvline(d, color="grey", linestyle=":", label="n = d")
        ax.set(xlabel="sequence length n", ylabel="ms per layer (forward)", title=f"d = {d}")
        ax.legend(fontsize=8)
    save_figure(fig, path)

