"""Faster CPU paths of scaled dot-product attention for measured cases (one query per row, GQA
included; square causal training attention; dropout on the weights), else ``attend`` itself.

Shape letters: b batch, h query heads, h_kv key/value heads, t_q queries, t_k keys, d_h head width."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.fast import switch
from aiayn.fast.block_causal import block_causal_attention, use_block_causal
from aiayn.fast.dropout import dropout
from aiayn.nn.attention import attend, scaled_dot_product_attention

# A single-query step takes the written-out path, eager, from this many queries (batch x heads)
# up (below it SDPA is faster); compiled, at every batch.
MIN_DECODE_QUERIES = 64


def fast_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None,
                   bias: Tensor | None = None, causal: bool = False, dropout_p: float = 0.0,
                   scale: float | None = None,
                   need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """``attend`` (same arguments, same result up to float rounding) by the fastest measured path."""
    plain = dict(mask=mask, bias=bias, causal=causal, dropout_p=dropout_p, scale=scale,
                 need_weights=need_weights)
    if (mask is not None and mask.dim() == 3) or (bias is not None and bias.dim() == 3):
        return scaled_dot_product_attention(q, k, v, **plain)  # checks, then reads it as (b, t_q, t_k)
    if q.device.type != "cpu" or need_weights or not switch.enabled():
        return attend(q, k, v, **plain)
    b, h, t_q, d_h = q.shape
    h_kv = k.shape[1]
    key_mask_only = mask is None or (mask.dim() == 4 and mask.shape[1:3] == (1, 1))  # (b, 1, 1, t_k)
    if (t_q == 1 and bias is None and dropout_p == 0.0 and key_mask_only
            and (b * h >= MIN_DECODE_QUERIES or torch.compiler.is_compiling())):
        # A decode step: the written-out equation's two matrix-vector products (its weights discarded),
        # each group of g query heads folded into its key/value head, (b, h_kv, g, d_h) (g = 1 without GQA).
        _check_heads(q, k)
        out, _ = attend(q.reshape(b, h_kv, h // h_kv, d_h), k, v, mask=mask, scale=scale, need_weights=True)
        return out.reshape(b, h, 1, d_h), None
    if (causal and mask is None and bias is None and t_q == k.shape[2]
            and use_block_causal(q, k, v, dropout_p)):  # training: see aiayn.fast.block_causal
        scale = d_h**-0.5 if scale is None else scale
        return block_causal_attention(q, k, v, scale), None
    if dropout_p > 0.0:  # the written-out equation with the faster dropout mask
        # The weights only (b, h, t_q, t_k): a zero-width v makes the function's own product free.
        _, weights = attend(q, k, v[..., :0], mask=mask, bias=bias, causal=causal, scale=scale, need_weights=True)
        assert weights is not None
        return dropout(weights, dropout_p) @ _repeat_heads(v, h), None  # (b, h, t_q, d_h)
    return attend(q, k, v, **plain)


def _check_heads(q: Tensor, k: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1] != 0:
        # Let the plain function raise its message for malformed inputs.
        scaled_dot_product_attention(q, k, k)


def _repeat_heads(v: Tensor, h: int) -> Tensor:
    """(b, h_kv, t_k, d_h) -> (b, h, t_k, d_h), each key/value head repeated for its query group."""
    return v if v.shape[1] == h else v.repeat_interleave(h // v.shape[1], dim=1)
