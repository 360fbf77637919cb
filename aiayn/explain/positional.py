"""The sinusoidal positional encoding (section 3.5): its curves, wavelengths, the claim that PE(t+k) is a
linear function of PE(t) (fitted, against the rotation it must be), and PE(t)·PE(t+k)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from aiayn.explain.base import Report, Table
from aiayn.nn.positional import sinusoidal_encoding
from aiayn.viz import save_figure

TITLE = "The sinusoidal encoding"
QUESTION = "its curves and wavelengths; PE(t+k) as a fixed linear map of PE(t); PE(t)·PE(t+k) against k"


def rotation(d_model: int, k: int) -> torch.Tensor:
    """The (d, d) float64 rotation R_k with PE(t+k) = R_k PE(t) in aiayn's interleaved layout."""
    omega = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    r = torch.zeros(d_model, d_model, dtype=torch.float64)
    c, s = torch.cos(k * omega), torch.sin(k * omega)
    r[0::2, 0::2] = torch.diag(c)  # sin(ω(t+k)) = sin ωt cos ωk + cos ωt sin ωk
    r[0::2, 1::2] = torch.diag(s)
    r[1::2, 0::2] = torch.diag(-s)  # cos(ω(t+k)) = cos ωt cos ωk − sin ωt sin ωk
    r[1::2, 1::2] = torch.diag(c)
    return r


def fit_shift(d_model: int, k: int, fit: torch.Tensor, test: torch.Tensor) -> dict[str, float]:
    """Least squares M_k with PE(t+k) ≈ M_k PE(t) over ``fit``: its errors, R_k's, |M_k − R_k| and cond."""
    x, y = (sinusoidal_encoding(fit + shift, d_model).double() for shift in (0, k))  # the model's table
    m = torch.linalg.lstsq(x, y).solution.T  # (d, d): y ≈ x M^T
    held_x, held_y = (sinusoidal_encoding(test + shift, d_model).double() for shift in (0, k))
    return {"k": k, "fit_residual": float((x @ m.T - y).abs().max()),
            "held_out_residual": float((held_x @ m.T - held_y).abs().max()),
            "rotation_residual": float((held_x @ rotation(d_model, k).T - held_y).abs().max()),
            "distance_to_rotation": float((m - rotation(d_model, k)).abs().max()),
            "condition": float(torch.linalg.cond(x))}


def run(out_dir: Path, *, quick: bool = False) -> Report:
    d_model = 64 if quick else 512
    n_fit = 4 * d_model  # positions to fit on
    generator = torch.Generator().manual_seed(0)
    spread = torch.randint(0, 1_000_000, (n_fit,), generator=generator)  # every wavelength turns
    window = torch.arange(n_fit)  # the first positions only: the slow pairs hardly move
    test = torch.randint(1_000_000, 2_000_000, (n_fit,), generator=generator)  # never seen
    offsets = [1, 10, 100] if quick else [1, 5, 10, 50, 100, 500]

    pairs = d_model // 2
    wavelength = [2 * math.pi * 10000 ** (2 * i / d_model) for i in range(pairs)]
    shown = sorted({0, 1, 2, pairs // 4, pairs // 2, 3 * pairs // 4, pairs - 2, pairs - 1})
    waves = Table(f"Wavelength of each (sin, cos) pair, d_model = {d_model}: 2π · 10000^(2i/d)",
                  ["pair i", "dimensions", "wavelength", "÷ 2π"],
                  [[i, f"{2 * i}, {2 * i + 1}", wavelength[i], wavelength[i] / (2 * math.pi)] for i in shown])

    fits = [fit_shift(d_model, k, spread, test) for k in offsets]
    window_fits = [fit_shift(d_model, k, window, test) for k in offsets]
    linear = Table(f"PE(t+k) = M_k PE(t): M_k fitted by least squares on {n_fit:,} positions, tested on "
                   f"{n_fit:,} others in [1,000,000, 2,000,000) (largest absolute error)",
                   ["k", "fitted on", "cond(PE)", "fit residual", "held-out residual", "R_k residual",
                    "max |M_k − R_k|"])
    for label, group in (("random t < 1,000,000", fits), (f"t = 0 … {n_fit - 1:,}", window_fits)):
        linear.rows += [[f["k"], label, f["condition"], f["fit_residual"], f["held_out_residual"],
                         f["rotation_residual"], f["distance_to_rotation"]] for f in group]

    starts = [0, 100, 1000]
    pe = sinusoidal_encoding(torch.arange(max(starts) + 2 * max(offsets) + 1), d_model).double()
    dot = Table("PE(t)·PE(t+k) for several t, and against the offset −k",
                ["k", *[f"t = {t}" for t in starts], "max spread over t", "PE(t)·PE(t−k) − PE(t)·PE(t+k), t = 1000"])
    spreads, mirror = [], []
    for k in [0, *offsets]:
        values = [float(pe[t] @ pe[t + k]) for t in starts]
        spreads.append(max(values) - min(values))
        t = starts[-1]
        mirror.append(float(pe[t] @ pe[t - k]) - values[-1])
        dot.rows.append([k, *values, spreads[-1], mirror[-1]])

    plot = out_dir / "positional.png"
    _plot(d_model, wavelength, pe, offsets, starts, plot)
    claims = {"d_model": d_model, "wavelength_min": wavelength[0], "wavelength_max": wavelength[-1],
              "ratio": wavelength[1] / wavelength[0], "fits": fits, "window_fits": window_fits,
              "dot_spread": max(spreads), "mirror": max(abs(m) for m in mirror)}
    window_worst = max(window_fits, key=lambda f: f["held_out_residual"])
    worst = max(fits, key=lambda f: f["held_out_residual"])
    text = f"""
**Question.** Section 3.5 says: "we hypothesized it would allow the model to easily learn to attend
by relative positions, since for any fixed offset k, PE(pos+k) can be represented as a linear
function of PE(pos)". Is it so, and what do the sinusoids look like?

**Measured** (d_model = {d_model}, aiayn's table `sinusoidal_encoding`, float32). The wavelengths form a
geometric progression with ratio 10000^(2/d) = {claims['ratio']:.5f}. They run from 2π = {wavelength[0]:.4f}
to {wavelength[-1]:,.0f} = 2π · 10000^((d−2)/d). The paper's "from 2π to 10000 · 2π" is the limit the
last pair approaches (2π · 10000 = {2 * math.pi * 10000:,.0f}). The first pairs turn once every few
positions; the last ones barely move over thousands. Each position gets a distinct code, like the
digits of a clock.

The linear map exists and does not depend on t. M_k is fitted by least squares on {n_fit:,} random
positions below 1,000,000. It predicts PE(t+k) from PE(t) on {n_fit:,} positions it never saw
(between 1,000,000 and 2,000,000). The largest error is {worst['held_out_residual']:.1g}, at
k = {worst['k']}: float32 rounding of the table. M_k is the rotation R_k that the addition formulas
give, a 2 x 2 rotation by k ω_i in each (sin, cos) pair (largest
|M_k − R_k|: {max(f['distance_to_rotation'] for f in fits):.1g}). R_k depends on k only, so one fixed
linear layer can shift a position by k.

A trap when checking it: fit on the first {n_fit:,} positions only, and the slow pairs barely turn.
The matrix of PE(t) then has condition number {window_worst['condition']:.2g}. Least squares finds
*a* map that fits those positions ({window_worst['fit_residual']:.1g}) but not R_k. It fails
elsewhere (held-out error {window_worst['held_out_residual']:.2g}). The data must cover every
wavelength to pin the map down.

The dot product PE(t)·PE(t+k) = Σ_i cos(k ω_i) depends on k alone. Its largest spread over
t = {', '.join(map(str, starts))} is {claims['dot_spread']:.1g}. It is the same for +k and −k
(largest difference {claims['mirror']:.1g}). So it says how far apart two positions are, not which
comes first. It falls from d/2 = {d_model // 2} at k = 0 and oscillates: nearby positions look alike.
"""
    return Report(TITLE, [waves, linear, dot], claims, [plot], text)


def _plot(d_model: int, wavelength: list[float], pe: torch.Tensor, offsets: list[int], starts: list[int],
          path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), layout="constrained")
    t = torch.arange(200)
    curves = sinusoidal_encoding(t, d_model)
    for dim in (0, 1, d_model // 4, d_model // 2):  # wavelengths 2π, 2π, 2π·10000^(1/4), 2π·100
        axes[0][0].plot(t.numpy(), curves[:, dim].numpy(), label=f"dim {dim}")
    axes[0][0].set(xlabel="position t", title="PE(t, dim): sines and cosines of falling frequency")
    axes[0][0].legend(fontsize=8)
    axes[0][1].semilogy(range(len(wavelength)), wavelength, ".")
    axes[0][1].axhline(2 * math.pi * 10000, linestyle=":", color="grey", label="10000 · 2π")
    axes[0][1].axhline(2 * math.pi, linestyle="--", color="grey", label="2π")
    axes[0][1].set(xlabel="pair i (dimensions 2i, 2i+1)", ylabel="wavelength",
                   title="wavelengths: a geometric progression")
    axes[0][1].legend()
    ks = torch.arange(-max(offsets), max(offsets) + 1)
    for start in (max(offsets), starts[-1]):  # t >= the largest offset: t + k >= 0
        axes[1][0].plot(ks.numpy(), (pe[start] * pe[start + ks]).sum(-1).numpy(), label=f"t = {start}",
                        linestyle="-" if start == max(offsets) else "--")
    axes[1][0].set(xlabel="offset k", title="PE(t)·PE(t+k): a function of k alone, symmetric")
    axes[1][0].legend()
    image = axes[1][1].imshow(rotation(d_model, 10)[:16, :16].numpy(), cmap="RdBu", vmin=-1, vmax=1)
    fig.colorbar(image, ax=axes[1][1], shrink=0.8)
    axes[1][1].set_title("R_10, the first 16 dimensions: 2 x 2 rotations")
    save_figure(fig, path)
