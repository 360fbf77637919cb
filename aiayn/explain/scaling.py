"""Why scale the scores by 1/sqrt(d_k) (section 3.2.1, footnote 4): unit-variance q·k has variance d_k, so
unscaled softmax rows saturate and their gradient vanishes. Measured on random vectors."""

from __future__ import annotations

from pathlib import Path

import torch

from aiayn.explain.base import Report, Table
from aiayn.viz import save_figure

TITLE = "Why scale by √d_k"
QUESTION = "what q·k's variance does to the softmax and its gradient, d_k = 4 … 512"

KEYS = 64  # keys per softmax row


def measure(d_k: int, *, pairs: int, rows: int, generator: torch.Generator) -> dict[str, float]:
    """Variance of q·k, and the max weight, entropy and gradient of softmax rows, unscaled and scaled."""
    q, k = torch.randn(2, pairs, d_k, generator=generator, dtype=torch.float64)
    dots = (q * k).sum(-1)  # (pairs,)
    out = {"d_k": d_k, "var": float(dots.var()), "var_scaled": float((dots / d_k**0.5).var())}
    queries = torch.randn(rows, 1, d_k, generator=generator, dtype=torch.float64)
    keys = torch.randn(rows, KEYS, d_k, generator=generator, dtype=torch.float64)
    upstream = torch.randn(rows, KEYS, generator=generator, dtype=torch.float64)
    for label, factor in (("", 1.0), ("_scaled", d_k**-0.5)):
        scores = ((queries * keys).sum(-1) * factor).requires_grad_()  # (rows, KEYS)
        weights = torch.softmax(scores, dim=-1)
        (weights * upstream).sum().backward()  # d(g·p)/d scores, one row at a time
        assert scores.grad is not None
        weights, grad = weights.detach(), scores.grad.norm(dim=-1)  # (rows, KEYS), (rows,)
        entropy = -(weights * weights.clamp_min(1e-300).log()).sum(-1)
        out[f"max_weight{label}"] = float(weights.max(-1).values.mean())
        out[f"one_hot{label}"] = float((weights.max(-1).values > 0.99).double().mean())
        out[f"entropy{label}"] = float(entropy.mean())
        out[f"grad{label}"] = float(grad.mean())
        out[f"grad_median{label}"] = float(grad.median())
    return out


def run(out_dir: Path, *, quick: bool = False) -> Report:
    dims = [4, 16, 64, 256] if quick else [4, 8, 16, 32, 64, 128, 256, 512]
    pairs, rows = (4000, 400) if quick else (50_000, 4000)
    generator = torch.Generator().manual_seed(0)
    results = [measure(d, pairs=pairs, rows=rows, generator=generator) for d in dims]

    variance = Table(f"Variance of q·k over {pairs:,} random pairs (components N(0, 1))",
                     ["d_k", "var(q·k)", "var(q·k) / d_k", "var(q·k / √d_k)"],
                     [[r["d_k"], r["var"], r["var"] / r["d_k"], r["var_scaled"]] for r in results])
    softmax = Table(f"Softmax over {KEYS} keys, mean of {rows:,} rows (uniform: max weight "
                    f"{1 / KEYS:.4g}, entropy {torch.log(torch.tensor(float(KEYS))):.4g} nats)",
                    ["d_k", "max weight", "scaled", "rows > 0.99", "scaled", "entropy", "scaled",
                     "‖∂/∂scores‖ mean", "scaled", "median", "scaled"],
                    [[r["d_k"], r["max_weight"], r["max_weight_scaled"], r["one_hot"], r["one_hot_scaled"],
                      r["entropy"], r["entropy_scaled"], r["grad"], r["grad_scaled"], r["grad_median"],
                      r["grad_median_scaled"]] for r in results])
    plot = out_dir / "scaling.png"
    _plot(results, plot)
    big = results[-1]
    claims = {"results": results, "largest": big}
    text = f"""
**Question.** Equation (1) divides the scores by √d_k. Why? The paper's footnote: if q and k have
independent components of mean 0 and variance 1, then q·k has mean 0 and variance d_k.

**Measured.** The variance of q·k grows exactly like d_k: the ratio stays near 1 from d_k = {dims[0]}
to {dims[-1]}. Divided by √d_k, the variance stays near 1.

Unscaled, at d_k = {big['d_k']}, the softmax over {KEYS} keys puts on average
**{big['max_weight']:.3f}** of its weight on one key (entropy {big['entropy']:.3g} nats).
{big['one_hot']:.0%} of the rows are one-hot to within 1% (max weight > 0.99).
The gradient reaching the scores has a median norm of **{big['grad_median']:.2g}**.
Its mean is {big['grad']:.3g}: the rows that are not saturated carry it.

Scaled, the largest weight is {big['max_weight_scaled']:.3f} (entropy {big['entropy_scaled']:.3g} nats,
of at most {torch.log(torch.tensor(float(KEYS))):.3g}). {big['one_hot_scaled']:.0%} of rows are one-hot.
The median gradient norm is **{big['grad_median_scaled']:.3g}**,
{big['grad_median_scaled'] / big['grad_median']:.0f}x larger.

A saturated softmax is nearly one-hot and passes almost no gradient to the queries and keys.
That is the "extremely small gradients" of section 3.2.1. At small d_k the unscaled scores are
merely sharper, and their gradient is not yet smaller: the harm grows with d_k.
Scaling keeps the scores' spread independent of d_k. The softmax then stays in its sensitive range
at any head width.

Additive attention (`aiayn explain additive`) has no such problem: tanh bounds each term.
"""
    return Report(TITLE, [variance, softmax], claims, [plot], text)


def _plot(results: list[dict[str, float]], path: Path) -> None:
    import matplotlib.pyplot as plt

    dims = [r["d_k"] for r in results]
    fig, (ax_var, ax_soft) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    ax_var.loglog(dims, [r["var"] for r in results], "o-", label="var(q·k)")
    ax_var.loglog(dims, [r["var_scaled"] for r in results], "s-", label="var(q·k / √d_k)")
    ax_var.loglog(dims, dims, ":", color="grey", label="d_k")
    ax_var.set(xlabel="d_k", ylabel="variance", title="q·k has variance d_k; scaled, 1")
    ax_var.legend()
    ax_soft.semilogx(dims, [r["max_weight"] for r in results], "o-", label="max weight, unscaled")
    ax_soft.semilogx(dims, [r["max_weight_scaled"] for r in results], "s-", label="max weight, scaled")
    ax_soft.semilogx(dims, [r["grad_median"] for r in results], "o--", label="median ‖gradient‖, unscaled")
    ax_soft.semilogx(dims, [r["grad_median_scaled"] for r in results], "s--", label="median ‖gradient‖, scaled")
    ax_soft.set(xlabel="d_k", title=f"softmax over {KEYS} keys: saturation and gradient")
    ax_soft.legend()
    save_figure(fig, path)
