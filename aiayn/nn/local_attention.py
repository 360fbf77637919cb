"""Restricted self-attention (the paper's Table 1), O(t · r · d) per layer: only the 2r + 1 scores
within ``radius``; equals ``scaled_dot_product_attention`` with ``sliding_window_mask``.

Shape letters: b batch, h heads, t length, d_h head width, w = 2r + 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def local_attention(q: Tensor, k: Tensor, v: Tensor, *, radius: int, causal: bool = False,
                    scale: float | None = None) -> Tensor:
    """softmax over the keys j with |i − j| <= radius (j <= i with ``causal``) of q_i·k_j · scale,
    times V; q, k, v (b, h, t, d_h) -> (b, h, t, d_h)."""
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"local_attention: q, k, v must share one (batch, heads, t, head_dim) shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if radius < 0:
        raise ValueError(f"local_attention: radius must be >= 0, got {radius}")
    t, d_h = q.shape[2], q.shape[3]
    width = 2 * radius + 1
    k_windows = F.pad(k, (0, 0, radius, radius)).unfold(2, width, 1)  # (b, h, t, d_h, w): keys i-r .. i+r
    v_windows = F.pad(v, (0, 0, radius, radius)).unfold(2, width, 1)
    scores = torch.einsum("bhtd,bhtdw->bhtw", q, k_windows) * (d_h**-0.5 if scale is None else scale)
    key_pos = torch.arange(t, device=q.device)[:, None] + torch.arange(-radius, radius + 1, device=q.device)  # (t, w)
    allowed = (key_pos >= 0) & (key_pos < t)  # the padding outside the sequence
    if causal:
        allowed &= key_pos <= torch.arange(t, device=q.device)[:, None]
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # (b, h, t, w)
    return torch.einsum("bhtw,bhtdw->bhtd", weights, v_windows)
