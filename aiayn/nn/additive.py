"""Additive attention (Bahdanau et al. 2015), the alternative of the paper's section 3.2.1:
score(q, k) = wᵀ tanh(q + k), q, k projected; elementwise work over (b, h, t_q, t_k, d_h), no matmul.

Shape letters: b batch, h heads, h_kv key/value heads, t_q queries, t_k keys, d_h head width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.nn.attention import MultiHeadAttention, _check_attention_inputs, _zero_rows
from aiayn.nn.masks import attention_masks


def additive_attention(q: Tensor, k: Tensor, v: Tensor, w: Tensor, *, mask: Tensor | None = None,
                       bias: Tensor | None = None, causal: bool = False, dropout_p: float = 0.0,
                       need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """softmax(wᵀ tanh(q_i + k_j) + bias, masked) V, w (h, d_h), otherwise ``scaled_dot_product_attention``."""
    _check_attention_inputs(q, k, v, mask, bias)
    if w.shape != (q.shape[1], q.shape[3]):
        raise ValueError(f"additive attention: w must be (heads, head_dim) = {(q.shape[1], q.shape[3])}, "
                         f"got {tuple(w.shape)}")
    if q.shape[1] != k.shape[1]:  # GQA: each key/value head serves h / h_kv query heads
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    masks = attention_masks(mask, bias, causal, q.shape[2], k.shape[2], q.dtype, q.device, fused=False)
    hidden = torch.tanh(q.unsqueeze(3) + k.unsqueeze(2))  # (b, h, t_q, t_k, d_h)
    scores = (hidden * w[None, :, None, None, :]).sum(-1)  # (b, h, t_q, t_k)
    if masks.bias is not None:  # -inf where masked
        scores = scores + masks.bias
    if masks.mask is not None:
        scores = scores.masked_fill(~masks.mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = F.dropout(weights, dropout_p) @ v  # (b, h, t_q, d_h)
    # A query that sees no key outputs zeros.
    return _zero_rows(out, masks.row_valid), (_zero_rows(weights, masks.row_valid) if need_weights else None)


class AdditiveAttentionKernel(nn.Module):
    """Additive attention's w per head, called like ``scaled_dot_product_attention`` (``scale`` ignored)."""

    def __init__(self, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_heads, head_dim) * head_dim**-0.5)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None,
                bias: Tensor | None = None, causal: bool = False, dropout_p: float = 0.0,
                scale: float | None = None, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        return additive_attention(q, k, v, self.w, mask=mask, bias=bias, causal=causal, dropout_p=dropout_p,
                                  need_weights=need_weights)


def use_additive_attention(model: nn.Module) -> nn.Module:
    """Give every ``MultiHeadAttention`` of ``model`` an additive kernel, in place; returns the model.
    Do not apply ``aiayn.fast.optimize`` afterwards: it would set its own kernel again."""
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.kernel = AdditiveAttentionKernel(module.n_heads, module.head_dim)
    return model
