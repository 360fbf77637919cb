"""What a mask does to the softmax (sections 3.2.1 and 3.2.3): a masked key's weight is exactly zero and the
visible weights still sum to 1; a query that sees no key at all is the trap (0/0)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from aiayn.explain.base import Report, Table
from aiayn.nn.attention import scaled_dot_product_attention
from aiayn.nn.masks import causal_mask, combine_masks, key_mask
from aiayn.viz import save_figure

TITLE = "What the mask does to the softmax"
QUESTION = "−∞ scores, exact zeros, and what happens to a query that sees no key"

T, D_H = 6, 8  # a sequence of 6 tokens, the last 2 padding; head width 8


def run(out_dir: Path, *, quick: bool = False) -> Report:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, T, D_H, generator=generator, dtype=torch.float64) for _ in range(3))
    valid = torch.tensor([[True, True, True, True, False, False]])  # (b, t): 2 padded tokens
    scores = (q @ k.transpose(-2, -1) / D_H**0.5)[0, 0]  # (t, t)
    weights = _weights_under_masks(q, k, v, valid)
    causal_table = Table("Causal mask: the weights of each query (rows) on each key (columns)",
                         ["query", *[f"key {j}" for j in range(T)]],
                         [[i, *weights["causal"][i].tolist()] for i in range(T)])
    fully, all_masked = _all_keys_masked(q, k, v, scores)
    tables = [_one_query_table(scores, valid), causal_table, fully]
    plot = out_dir / "masks.png"
    _plot(weights, plot)
    pad_w = weights["padding"]
    claims = {
        "padded_weight_max": float(pad_w[:, 4:].abs().max()),
        "row_sum_error": float((pad_w.sum(-1) - 1).abs().max()),
        "causal_future_max": float(weights["causal"].triu(1).abs().max()),
        **all_masked,
    }
    return Report(TITLE, tables, claims, [plot], _text(claims))


def _weights_under_masks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The (t, t) attention weights under the padding mask, the causal mask and both."""
    padding = key_mask(valid)  # (1, 1, 1, t)
    causal = causal_mask(T)  # (1, 1, t, t)
    both = combine_masks(padding, causal)
    assert both is not None
    weights = {}
    for name, mask in (("padding", padding), ("causal", causal), ("causal + padding", both)):
        _, w = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=True)
        assert w is not None
        weights[name] = w[0, 0]
    return weights


def _one_query_table(scores: torch.Tensor, valid: torch.Tensor) -> Table:
    row = Table("One query (token 0) over the 6 keys, keys 4 and 5 padded",
                ["", *[f"key {j}" for j in range(T)], "sum"])
    masked_row = scores[0].masked_fill(~valid[0], float("-inf"))
    row.rows = [["score q·k/√d", *scores[0].tolist(), "—"],
                ["masked score", *masked_row.tolist(), "—"],
                ["softmax", *torch.softmax(masked_row, -1).tolist(), float(torch.softmax(masked_row, -1).sum())],
                ["softmax, unmasked", *torch.softmax(scores[0], -1).tolist(), float(torch.softmax(scores[0], -1).sum())]]
    return row


def _all_keys_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scores: torch.Tensor) -> tuple[Table, dict[str, Any]]:
    """A query that sees no key, four ways: the table and claims."""
    none_visible = torch.zeros(1, 1, 1, T, dtype=torch.bool)
    row_scores = scores[4:5]
    naive = torch.softmax(row_scores.masked_fill(~none_visible[0, 0], float("-inf")), -1)[0]
    big_negative = torch.softmax(row_scores.masked_fill(~none_visible[0, 0], -1e9), -1)[0]
    sdpa = F.scaled_dot_product_attention(q[:, :, 4:5], k, v, attn_mask=none_visible)[0, 0, 0]
    ours_out, ours_w = scaled_dot_product_attention(q[:, :, 4:5], k, v, mask=none_visible, need_weights=True)
    ours_fused, _ = scaled_dot_product_attention(q[:, :, 4:5], k, v, mask=none_visible)
    assert ours_w is not None
    mean_of_values = v[0, 0].mean(0)
    fully = Table("A query whose keys are all masked (one row), four ways",
                  ["method", "weights", "output", "NaN?"], [
        ["masked_fill(−∞) + softmax", _short(naive), "NaN", bool(naive.isnan().any())],
        ["masked_fill(−1e9) + softmax (Annotated Transformer)", _short(big_negative),
         f"mean of all values (max |diff| {float((big_negative @ v[0, 0] - mean_of_values).abs().max()):.1g})",
         bool(big_negative.isnan().any())],
        [f"F.scaled_dot_product_attention (torch {torch.__version__.split('+')[0]})", "—", _short(sdpa),
         bool(sdpa.isnan().any())],
        ["aiayn scaled_dot_product_attention", _short(ours_w[0, 0, 0]), _short(ours_out[0, 0, 0]),
         bool(ours_out.isnan().any() or ours_fused.isnan().any())],
    ])
    # the gradient through a padded row stays finite too
    qg = q[:, :, 4:5].clone().requires_grad_()
    scaled_dot_product_attention(qg, k, v, mask=none_visible)[0].sum().backward()
    assert qg.grad is not None
    return fully, {
        "naive_nan": bool(naive.isnan().all()),
        "big_negative_uniform": float((big_negative - 1 / T).abs().max()),
        "sdpa_zero": float(sdpa.abs().max()),
        "ours_zero": float(ours_out.abs().max()) + float(ours_fused.abs().max()),
        "ours_grad_finite": bool(torch.isfinite(qg.grad).all()),
    }


def _text(claims: dict[str, Any]) -> str:
    sdpa_says = ("returns NaN" if math.isnan(claims["sdpa_zero"]) else
                 f"returns zeros (largest |output| {claims['sdpa_zero']})" if claims["sdpa_zero"] == 0 else
                 f"returns a row of largest |output| {claims['sdpa_zero']:.3g}")
    return f"""**Question.** How does a mask act inside softmax(QKᵀ/√d_k)? And what happens to a query that may
attend to nothing (a padded position, or a row that a combined mask empties)?

**Measured.** Setting a masked score to −∞ makes its weight exactly zero. The largest weight on a
padded key here is {claims['padded_weight_max']}. The visible keys' weights still sum to 1 (largest
error {claims['row_sum_error']:.1g}). Masking renormalises over what is left, as if the masked keys did
not exist. The causal mask leaves every query's future at exactly {claims['causal_future_max']}.

A row with **no** visible key is where implementations differ. The plain recipe, masked_fill(−∞)
then softmax, gives NaN (exp(−∞)/Σ = 0/0), and the NaN spreads through the next matmul into the
loss. Filling with −1e9 instead (the Annotated Transformer) avoids the NaN but makes the row uniform.
Its largest deviation from 1/{T} is {claims['big_negative_uniform']:.1g}: the query averages the
values of keys it was told not to see. PyTorch {torch.__version__.split('+')[0]}'s fused kernel {sdpa_says}.

In aiayn, a query that sees no key outputs zeros and zero weights, in both its paths, with a finite
gradient (`aiayn/nn/attention.py`, `tests/parity/test_attention_paths.py`). With the −∞
convention a mask is also just an additive bias of 0 / −∞. That is how aiayn combines masks with
ALiBi or T5 biases.

3-D masks are (batch, q_len, k_len), the same for every head (`aiayn/nn/masks.py`).
"""


def _short(x: torch.Tensor) -> str:
    return "[" + ", ".join(f"{float(v):.3g}" for v in x[:4]) + (", …]" if x.numel() > 4 else "]")


def _plot(weights: dict[str, torch.Tensor], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(weights), figsize=(4 * len(weights), 3.8), layout="constrained")
    for ax, (name, w) in zip(axes, weights.items(), strict=True):
        image = ax.imshow(w.numpy(), vmin=0, vmax=float(w.max()), cmap="viridis")
        fig.colorbar(image, ax=ax, shrink=0.8)
        ax.set(title=f"{name} mask: weights", xlabel="key (4, 5: padding)", ylabel="query")
    save_figure(fig, path)
