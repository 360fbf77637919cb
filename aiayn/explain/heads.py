"""What several heads cost (section 3.2.2): h heads of width d_model / h against one of width d_model,
counted with FlopCounterMode on the written-out MultiHeadAttention."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from aiayn.explain.base import Report, Table, timed
from aiayn.models import count_parameters
from aiayn.nn.attention import MultiHeadAttention
from aiayn.viz import save_figure

TITLE = "One head or h heads: the same parameters and FLOPs"
QUESTION = "do h heads cost more than one head of the full width? (measured: no)"


def measure(d_model: int, n_heads: int, seq_len: int, batch: int) -> dict[str, float]:
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model, n_heads, impl="reference").eval()
    x = torch.randn(batch, seq_len, d_model)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        mha(x)
    counts = counter.get_flop_counts()
    projections = sum(sum(counts.get(f"MultiHeadAttention.{p}", {}).values()) for p in ("qkv_proj", "out_proj"))
    total = counter.get_total_flops()

    fused = MultiHeadAttention(d_model, n_heads).eval()
    fused.load_state_dict(mha.state_dict())
    with torch.no_grad():
        ms = 1e3 * timed(lambda: mha(x), repeat=7)
        ms_fused = 1e3 * timed(lambda: fused(x), repeat=7)
    return {"h": n_heads, "d_k": d_model // n_heads, "params": count_parameters(mha), "flops": total,
            "projection_flops": projections, "attention_flops": total - projections,
            "softmax_elements": batch * n_heads * seq_len**2,
            "ms": ms, "ms_fused": ms_fused}


def run(out_dir: Path, *, quick: bool = False) -> Report:
    d_model, seq_len, batch = (128, 32, 2) if quick else (512, 256, 8)
    heads = [1, 2, 4, 8] if quick else [1, 2, 4, 8, 16, 32]
    results = [measure(d_model, h, seq_len, batch) for h in heads]
    table = Table(f"Self-attention of {batch} x {seq_len} tokens, d_model = {d_model} (forward)",
                  ["heads h", "d_k = d_model/h", "parameters", "FLOPs", "projections", "QKᵀ and AV",
                   "softmax elements", "ms (written out)", "ms (fused kernel)"],
                  [[r["h"], r["d_k"], r["params"], r["flops"], r["projection_flops"], r["attention_flops"],
                    r["softmax_elements"], r["ms"], r["ms_fused"]] for r in results])
    plot = out_dir / "heads.png"
    _plot(results, plot)
    one, many = results[0], results[-1]
    claims = {"results": results}
    timing = ("More, smaller matrix products and h softmax maps of t x t use the CPU less well"
              if many["ms"] > one["ms"] else "Here the split did not slow it down")
    text = f"""
**Question.** Multi-head attention runs h attention functions in parallel. Does that cost h times
one head's parameters or computation?

**Measured.** No. With d_k = d_model / h, as in the paper, every h from {heads[0]} to {heads[-1]} has
exactly {one['params']:,} parameters and {one['flops']:,} FLOPs for this input.
FlopCounterMode puts {one['projection_flops']:,} of them in the four projections and
{one['attention_flops']:,} in QKᵀ and the weighted sum of values.
The projections are the same d_model x d_model matrices, only read as h slices.
QKᵀ costs h x (t² d_k) = t² d_model whatever h is. The paper says it (section 3.2.2): "the total
computational cost is similar to that of single-head attention with full dimensionality".

FlopCounterMode counts matrix products only. The softmax is the one part that grows with h: h maps
of t x t scores. That is {one['softmax_elements']:,} exponentials for one head and
{many['softmax_elements']:,} for {many['h']}. This elementwise work is small next to the products
while t is below about d_model.

Wall time is another matter. One head took {one['ms']:.2f} ms written out, {many['h']} heads
{many['ms']:.2f} ms. In the fused kernel they took {one['ms_fused']:.2f} and {many['ms_fused']:.2f} ms.
{timing}. Timings move between runs: the ratio, not the milliseconds, is the point.

What heads buy is not cheaper compute but h different attention distributions per position.
One head can only average; h heads can look at h places at once.
In Table 3 row (A), 1 head is 0.9 BLEU worse than 8.
"""
    return Report(TITLE, [table], claims, [plot], text)


def _plot(results: list[dict[str, float]], path: Path) -> None:
    import matplotlib.pyplot as plt

    heads = [r["h"] for r in results]
    fig, (ax_cost, ax_time) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    ax_cost.semilogx(heads, [r["flops"] / results[0]["flops"] for r in results], "o-", base=2, label="FLOPs")
    ax_cost.semilogx(heads, [r["params"] / results[0]["params"] for r in results], "s--", base=2,
                     label="parameters")
    ax_cost.set_ylim(0, 2)
    ax_cost.set(xlabel="heads h (d_k = d_model / h)", ylabel="relative to one head", title="cost of h heads: flat")
    ax_cost.legend()
    ax_time.semilogx(heads, [r["ms"] for r in results], "o-", base=2, label="written out")
    ax_time.semilogx(heads, [r["ms_fused"] for r in results], "s-", base=2, label="fused kernel")
    ax_time.set(xlabel="heads h", ylabel="ms per forward", title="wall time (CPU, shared machine)")
    ax_time.legend()
    save_figure(fig, path)
