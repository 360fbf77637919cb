"""A paged cache's prefill chunks: the chunk's mask turned into SDPA's form once per forward, not once
per layer (``prepared_mask`` keeps the last ``RECENT``). For more than ``MAX_QUERIES`` queries per row
on the CPU, a bool mask or none; equal to the plain path.

Shape letters: b rows, h query heads, h_kv key/value heads, t_q new tokens, t_k keys, d_h head width."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.fast import switch
from aiayn.nn.attention import AttentionInputs
from aiayn.nn.kv_layer import ROWS, LayerKVCache


@dataclass
class PreparedMask:
    """A bool mask in SDPA's additive form, and the queries that see no key."""

    mask: Tensor  # the bool mask it was made from (b or 1, 1, t_q, t_k), kept: the cache's key
    additive: Tensor  # float (b or 1, 1, t_q, t_k): 0 where a key is seen, -inf elsewhere
    row_valid: Tensor | None  # bool (b or 1, 1, t_q, 1): False for queries that see no key; None: all see one


# The masks of the current forward, newest last (one per prefill part; every layer visits them in turn).
_recent: list[PreparedMask] = []
RECENT, RECENT_BYTES = 32, 64 << 20  # entries kept, and their additive masks' bytes (the newest always)


def prepared_mask(mask: Tensor, dtype: torch.dtype) -> PreparedMask:
    """``mask`` (b or 1, 1, t_q, t_k) in SDPA's additive form of ``dtype`` (queries that see no key see
    every key, zeroed by the caller), computed once per mask tensor."""
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


def reads_rows(q: Tensor, cache: LayerKVCache | tuple[Tensor, Tensor] | None, inputs: AttentionInputs) -> bool:
    """What both paged-cache paths need: a CPU q (b, h, t_q, d_h) over a paged cache's rows, no bias or
    causal flag, and the cache's bool mask (b or 1, 1, 1 or t_q, t_k) or none."""
    mask = inputs.mask
    return (isinstance(cache, LayerKVCache) and cache.read_blocks is not None
            and q.device.type == "cpu" and q.dim() == 4
            and inputs.bias is None and not inputs.causal
            and inputs.slots is not None and inputs.slots.kind == ROWS
            and (mask is None or (mask.dim() == 4 and mask.dtype == torch.bool and mask.shape[1] == 1
                                  and mask.shape[0] in (1, q.shape[0]) and mask.shape[2] in (1, q.shape[2])
                                  and mask.shape[3] == cache.read_end)))


def applies(q: Tensor, cache: LayerKVCache | tuple[Tensor, Tensor] | None, inputs: AttentionInputs, max_queries: int) -> bool:
    """Whether ``prefill_cache_attention`` takes this call (the module docstring's conditions)."""
    return (reads_rows(q, cache, inputs) and switch.kernel_enabled("prefill_attention") and q.is_floating_point()
            and q.shape[2] > max_queries and (inputs.mask is None or inputs.mask.shape[2] == q.shape[2]))


def prefill_cache_attention(q: Tensor, k: Tensor, v: Tensor, cache: LayerKVCache, inputs: AttentionInputs,
                            scale: float | None = None) -> Tensor:
    """Write k, v (b, h_kv, t_q, d_h) into ``cache``; attend q (b, h, t_q, d_h) over the rows' keys."""
    assert inputs.slots is not None  # (applies)
    keys, values = cache.write(k, v, inputs.slots)  # (b, h_kv, t_k, d_h) each
    gqa = q.shape[1] != keys.shape[1]
    if inputs.mask is None:
        return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=gqa)
    prepared = prepared_mask(inputs.mask, q.dtype)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=prepared.additive, scale=scale,
                                         enable_gqa=gqa)  # (b, h, t_q, d_h)
    return out if prepared.row_valid is None else out.masked_fill(~prepared.row_valid, 0.0)
