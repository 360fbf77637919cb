"""A paged cache's prefill chunks: the chunk's mask turned into SDPA's form once per forward, not
once per layer.

A prefill chunk (t_q > 1 new tokens per row) over a ``PagedKVCache`` attends under the stack's
position-causal key mask, (b, 1, t_q, t_k) bool, the same tensor for every layer of the forward.
The plain path (``aiayn.nn.attention.scaled_dot_product_attention``) prepares it in every layer:
it finds the queries that see no key (``mask.any``: padding rows of a ragged chunk), lets them see
every key (``mask | ~row_valid``) so the softmax stays finite, and zeroes their outputs after; and
``F.scaled_dot_product_attention`` turns the bool mask into an additive float one (0 / -inf)
inside every call. Both cost time in every layer of a chunked prefill (``python -m
benchmarks.prefill``; the figures are in docs/benchmarks.md).

``prefill_cache_attention`` writes the new keys and values as the plain path does
(``PagedLayerKVCache.write``: store, then the rows' keys gathered or viewed) and calls
``F.scaled_dot_product_attention`` with the additive mask that ``prepared_mask`` computed for this
mask tensor, zeroing the outputs of queries that see no key (only when some exist). The same
computation as the plain path: SDPA's own conversion of a bool mask is ``where(mask, 0, -inf)``.

``prepared_mask`` keeps the last ``RECENT`` mask tensors it saw, up to ``RECENT_BYTES`` of
prepared masks (strong references, so that an identity cannot be reused by another tensor while
it is kept) and what it computed from each. The stack builds a fresh mask tensor for each
forward, or each part of a ragged forward, and never changes it in place
(``aiayn.models.blocks.TransformerStack``), so an entry is reused by the forward's layers (a
ragged forward's parts take turns in every layer: one entry each) and falls out as later
forwards' masks come.

It applies to a ``PagedLayerKVCache`` chunk of more than ``aiayn.fast.paged_attention.MAX_QUERIES``
queries per row on the CPU, a bool (b or 1, 1, t_q, t_k) mask or none, no additive bias, no slot
causal flag (a packed batch's queries arrive unpacked, as every kernel gets them), no dropout or
weights (the caller, ``MultiHeadAttention``, takes the plain path for those), aiayn's kernels on
(``aiayn.fast.switch``). Equal to the plain path: tests/consistency/test_prefill_attention.py.

Shape letters: b rows, h query heads, h_kv key/value heads, t_q new tokens, t_k keys, d_h head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.fast import switch
from aiayn.nn.attention import AttentionInputs
from aiayn.nn.kv_cache import ROWS, LayerKVCache, StaticKV
from aiayn.nn.paged_kv_cache import PagedLayerKVCache


@dataclass
class PreparedMask:
    """A bool mask in SDPA's additive form, and the queries that see no key."""

    mask: Tensor  # the bool mask it was made from (b or 1, 1, t_q, t_k), kept: the cache's key
    additive: Tensor  # float (b or 1, 1, t_q, t_k): 0 where a key is seen, -inf elsewhere
    row_valid: Tensor | None  # bool (b or 1, 1, t_q, 1): False for queries that see no key; None: all see one


# The masks of the current forward, newest last: a step's prefill parts (one per prompt row,
# ``aiayn.serve.steps``) each have a mask, and every layer visits the parts in turn.
_recent: list[PreparedMask] = []
RECENT, RECENT_BYTES = 32, 64 << 20  # entries kept, and their additive masks' bytes (the newest always)


def prepared_mask(mask: Tensor, dtype: torch.dtype) -> PreparedMask:
    """``mask`` (bool, (b or 1, 1, t_q, t_k), True = may attend) in SDPA's additive form of ``dtype``:
    queries that see no key see every key instead (a finite softmax; their outputs are zeroed by
    the caller with ``row_valid``), as ``aiayn.nn.attention.scaled_dot_product_attention`` does.
    Computed once per mask tensor (see the module docstring)."""
    for entry in reversed(_recent):
        if entry.mask is mask and entry.additive.dtype == dtype and entry.additive.device == mask.device:
            return entry
    row_valid = mask.any(dim=-1, keepdim=True)  # (b or 1, 1, t_q, 1)
    empty = not bool(row_valid.all())  # a read of the data: CPU only (see ``applies``)
    seen = mask | ~row_valid if empty else mask
    additive = torch.zeros(seen.shape, dtype=dtype, device=mask.device).masked_fill_(~seen, float("-inf"))
    entry = PreparedMask(mask, additive, row_valid if empty else None)
    _recent.append(entry)
    while len(_recent) > 1 and (len(_recent) > RECENT or sum(e.additive.nbytes for e in _recent) > RECENT_BYTES):
        del _recent[0]
    return entry


def applies(q: Tensor, cache: LayerKVCache | StaticKV | None, inputs: AttentionInputs, max_queries: int) -> bool:
    """Whether ``prefill_cache_attention`` takes this call (the module docstring's conditions)."""
    mask = inputs.mask
    return (isinstance(cache, PagedLayerKVCache) and cache.read_blocks is not None
            and switch.kernel_enabled("prefill_attention") and q.device.type == "cpu" and q.is_floating_point()
            and q.dim() == 4 and q.shape[2] > max_queries
            and inputs.bias is None and not inputs.causal
            and inputs.slots is not None and inputs.slots.kind == ROWS
            and (mask is None or (mask.dim() == 4 and mask.dtype == torch.bool and mask.shape[1] == 1
                                  and mask.shape[0] in (1, q.shape[0]) and mask.shape[2] == q.shape[2]
                                  and mask.shape[3] == cache.read_end)))


def prefill_cache_attention(q: Tensor, k: Tensor, v: Tensor, cache: PagedLayerKVCache, inputs: AttentionInputs,
                            scale: float | None = None) -> Tensor:
    """Write k, v (b, h_kv, t_q, d_h) into ``cache`` and attend q (b, h, t_q, d_h) over the rows' keys
    (cached + new) under ``inputs.mask``: (b, h, t_q, d_h). Check ``applies`` first."""
    assert inputs.slots is not None  # (applies)
    keys, values = cache.write(k, v, inputs.slots)  # (b, h_kv, t_k, d_h) each
    gqa = q.shape[1] != keys.shape[1]
    if inputs.mask is None:
        return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=gqa)
    prepared = prepared_mask(inputs.mask, q.dtype)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=prepared.additive, scale=scale,
                                         enable_gqa=gqa)  # (b, h, t_q, d_h)
    return out if prepared.row_valid is None else out.masked_fill(~prepared.row_valid, 0.0)
