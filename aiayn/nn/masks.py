"""The one mask convention of aiayn: **a bool tensor, True = "this query may attend to this key"**
(``F.scaled_dot_product_attention``'s; the opposite of ``nn.MultiheadAttention``'s
``key_padding_mask``), broadcast against scores (b, h, t_q, t_k). 4-D as it stands; **3-D
(b, t_q, t_k): one mask per batch element, shared by the heads**; 2-D and 1-D: the same for every
batch element and head. Additive biases (ALiBi, T5) have the same shapes. A query whose keys are all
masked outputs zero, never NaN."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def valid_tokens(tokens: Tensor, pad_id: int | None, valid: Tensor | None = None) -> Tensor:
    """(b, t) bool, True at real tokens: ``valid`` (checked), else ``tokens != pad_id`` (all True without)."""
    if valid is None:
        return tokens != pad_id if pad_id is not None else torch.ones_like(tokens, dtype=torch.bool)
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor (True = real token), got dtype "
                        f"{getattr(valid, 'dtype', type(valid).__name__)}")
    if valid.shape != tokens.shape:
        raise ValueError(f"valid must have the tokens' shape {tuple(tokens.shape)}, got {tuple(valid.shape)}")
    return valid


def key_mask(valid: Tensor) -> Tensor:
    """(b, t_k) bool validity of keys -> (b, 1, 1, t_k), broadcastable over heads and queries."""
    return valid[:, None, None, :]


def causal_mask(q_len: int, k_len: int | None = None, *, device: torch.device | None = None) -> Tensor:
    """Right-aligned causal mask (1, 1, t_q, t_k): query i sits at key position ``t_k - t_q + i``."""
    k_len = q_len if k_len is None else k_len
    if k_len < q_len:
        raise ValueError(f"causal_mask: k_len ({k_len}) must be >= q_len ({q_len}); the queries are the last "
                         f"q_len of the keys")
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # (t_q, 1)
    k_pos = torch.arange(k_len, device=device)[None, :]  # (1, t_k)
    return (k_pos <= q_pos)[None, None]


def sliding_window_mask(q_len: int, k_len: int | None = None, *, radius: int,
                        causal: bool = False, device: torch.device | None = None) -> Tensor:
    """Restricted attention (the paper's Table 1): query i sees the keys within ``radius`` (only earlier
    ones with ``causal``), (1, 1, t_q, t_k), right-aligned like ``causal_mask``."""
    k_len = q_len if k_len is None else k_len
    if radius < 0 or k_len < q_len:
        raise ValueError(f"sliding_window_mask: need radius >= 0 and k_len >= q_len, got radius {radius}, "
                         f"q_len {q_len}, k_len {k_len}")
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # (t_q, 1)
    k_pos = torch.arange(k_len, device=device)[None, :]  # (1, t_k)
    near = (q_pos - k_pos).abs() <= radius
    return (near & (k_pos <= q_pos) if causal else near)[None, None]


def scores_shaped(mask: Tensor | None) -> Tensor | None:
    """A mask or bias with the scores' 4 dimensions: a 3-D (b, t_q, t_k) one becomes (b, 1, t_q, t_k)."""
    return mask[:, None] if mask is not None and mask.dim() == 3 else mask


def position_causal_mask(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """(b, t_q), (b, t_k) position ids -> (b, 1, t_q, t_k): causality for rows whose slots do not line up."""
    return (k_positions[:, None, :] <= q_positions[:, :, None])[:, None]


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the given masks (None entries are skipped); None if all are None."""
    out: Tensor | None = None
    for mask in masks:
        if mask is not None:
            out = mask if out is None else out & mask
    return out


@dataclass
class AttentionMasks:
    """One attention call's masks, prepared by ``attention_masks`` for equation (1)."""

    mask: Tensor | None  # bool (.., t_q, t_k), True = may attend; None when folded into ``bias``
    bias: Tensor | None  # float (.., t_q, t_k) in the queries' dtype, -inf where masked
    row_valid: Tensor | None  # bool (.., t_q, 1): False for a query that sees no key (outputs zeros)
    is_causal: bool  # square causal and nothing else: the fused kernel masks the future itself

    @property
    def combined(self) -> Tensor | None:
        """The one mask the fused kernel takes: the additive bias, else the bool mask."""
        return self.bias if self.bias is not None else self.mask


def attention_masks(mask: Tensor | None, bias: Tensor | None, causal: bool, t_q: int, t_k: int,
                    dtype: torch.dtype, device: torch.device, *, fused: bool) -> AttentionMasks:
    """The masks of t_q queries over t_k keys: ``mask``, ``bias``, right-aligned causal, and a query that
    sees no key made to see every key (zeroed by ``row_valid``). ``fused``: SDPA masks square causal itself."""
    mask, bias = scores_shaped(mask), scores_shaped(bias)  # 3-D: (b, t_q, t_k) -> (b, 1, t_q, t_k)
    is_causal = fused and causal and mask is None and bias is None and t_q == t_k
    callers_mask = mask is not None  # may leave a query no key (a right-aligned causal mask never does)
    if causal and t_q > 1 and not is_causal:
        mask = combine_masks(mask, causal_mask(t_q, t_k, device=device))  # (.., t_q, t_k)
    row_valid = mask.any(dim=-1, keepdim=True) if callers_mask else None  # (.., t_q, 1)
    mask = mask | ~row_valid if row_valid is not None else mask
    if bias is not None:  # the additive form of mask + bias: -inf where masked
        bias = bias.to(dtype) if mask is None else bias.to(dtype).masked_fill(~mask, float("-inf"))
        mask = None
    return AttentionMasks(mask, bias, row_valid, is_causal)
