"""The one mask convention of aiayn.

**A mask is a boolean tensor in which True means "this query may attend to this key".**
It broadcasts against attention scores of shape (b, h, t_q, t_k). This is the convention of
``torch.nn.functional.scaled_dot_product_attention``; note it is the *opposite* of
``torch.nn.MultiheadAttention``'s ``key_padding_mask`` (True = ignore).

Its dimensions, by count (``scores_shaped``):

* 4-D (b or 1, h or 1, t_q or 1, t_k): as it stands;
* **3-D (b or 1, t_q or 1, t_k): one mask per batch element, the same for every head** (read as
  (b, 1, t_q, t_k), as the Annotated Transformer and most tutorials build it). Plain broadcasting
  would read it as (h, t_q, t_k) and, when the batch size equals the number of heads, silently
  give batch element i's mask to head i. ``torch.nn.MultiheadAttention``'s 3-D ``attn_mask``, (b·h,
  t_q, t_k), is a third convention: reshape it to (b, h, t_q, t_k) first;
* 2-D (t_q or 1, t_k) and 1-D (t_k,): the same for every batch element and head.

Additive biases (ALiBi, T5 relative bias, or a user's float mask) are float tensors of the same
broadcast shape, added to the scores before the softmax. A query whose keys are all masked
attends to nothing: its output is zero (never NaN).

Helpers here build the usual masks and combine them by logical AND.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def valid_tokens(tokens: Tensor, pad_id: int | None, valid: Tensor | None = None) -> Tensor:
    """(b, t) bool, True at real tokens: ``valid`` when given (checked: a bool tensor of the
    tokens' shape), else ``tokens != pad_id``, or all True when the model has no pad_id.

    The one rule for which tokens are real, used by the stacks and by every decoder."""
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
    """Right-aligned causal mask, (1, 1, t_q, t_k).

    The t_q queries are the *last* t_q positions of the t_k keys: query i sits at key position
    ``t_k - t_q + i`` and may see keys 0..that position. With t_q == t_k this is the usual lower
    triangle; with t_q < t_k it is what a cached decode step with several new tokens needs
    (a top-left aligned triangle would hide keys the new tokens are allowed to see).
    """
    k_len = q_len if k_len is None else k_len
    if k_len < q_len:
        raise ValueError(
            f"causal_mask: k_len ({k_len}) must be >= q_len ({q_len}); the queries are the last "
            f"q_len of the keys"
        )
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # (t_q, 1)
    k_pos = torch.arange(k_len, device=device)[None, :]  # (1, t_k)
    return (k_pos <= q_pos)[None, None]


def sliding_window_mask(q_len: int, k_len: int | None = None, *, radius: int,
                        causal: bool = False, device: torch.device | None = None) -> Tensor:
    """Restricted (local) attention, the paper's Table 1: query i may see the keys within ``radius``
    positions of it (only the earlier ones with ``causal``), (1, 1, t_q, t_k). Right-aligned like
    ``causal_mask``: the t_q queries are the last t_q positions of the t_k keys."""
    k_len = q_len if k_len is None else k_len
    if radius < 0 or k_len < q_len:
        raise ValueError(f"sliding_window_mask: need radius >= 0 and k_len >= q_len, got radius {radius}, "
                         f"q_len {q_len}, k_len {k_len}")
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # (t_q, 1)
    k_pos = torch.arange(k_len, device=device)[None, :]  # (1, t_k)
    near = (q_pos - k_pos).abs() <= radius
    return (near & (k_pos <= q_pos) if causal else near)[None, None]


def scores_shaped(mask: Tensor | None) -> Tensor | None:
    """A mask or additive bias with the scores' 4 dimensions: a 3-D (b, t_q, t_k) one becomes
    (b, 1, t_q, t_k), shared by the heads (see the module doc); others are left as they are."""
    return mask[:, None] if mask is not None and mask.dim() == 3 else mask


def position_causal_mask(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """(b, t_q) query and (b, t_k) key position ids -> (b, 1, t_q, t_k): True where the key's
    position is at most the query's.

    Causality by position rather than by slot order: for a cache whose rows fill independently
    (``aiayn.nn.row_kv_cache``) the rows' slots do not line up, so the right-aligned slot mask
    does not apply; within a row positions grow with the slots, so this is the same mask there.
    """
    return (k_positions[:, None, :] <= q_positions[:, :, None])[:, None]


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the given masks (None entries are skipped); None if all are None."""
    out: Tensor | None = None
    for mask in masks:
        if mask is None:
            continue
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
    """The masks of attention from t_q queries to t_k keys: the caller's ``mask`` and ``bias``
    (3-D ones shared by the heads), causal right-aligned (the t_q queries are the last t_q keys),
    and a query that sees no key made to attend everywhere (a finite softmax; its output is then
    set to zero by ``row_valid``). ``fused``: for the fused kernel, which masks a square causal
    call itself."""
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
