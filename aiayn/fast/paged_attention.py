"""Attention straight from a paged KV cache's blocks: the one place that chooses it.

A ``PagedKVCache`` layer (``aiayn.nn.paged_kv_cache``) answers ``write`` by gathering every row's
blocks into the contiguous (b, h_kv, t_k, d_h) layout ``F.scaled_dot_product_attention`` reads: a
copy of every key and value the step attends to, each layer each step. ``paged_cache_attention``
instead stores the new keys and values (``PagedLayerKVCache.store``) and runs
``paged_attention.cpp`` (vLLM's PagedAttention on the CPU, in miniature), which reads them in place
through the block table. ``aiayn.fast.optimize`` sets it as ``MultiHeadAttention.cache_kernel``;
the attention module calls it first and takes the plain path (``write`` + its attention kernel)
whenever it answers None.

It applies to (and only to), everything else staying on the plain gather + SDPA, the reference:

* a ``PagedLayerKVCache`` read through its block table (``read_run`` None: not the single row of
  consecutive blocks, which the plain path reads as a view of the pool, no copy);
* float32 queries and pool on the CPU, the kernel built (a C++ compiler; ``paged_attention_build``),
  aiayn's kernels on (``aiayn.fast.switch``);
* at most ``MAX_QUERIES`` new tokens per row (decode steps, short chunks; a long prefill chunk is
  SDPA's matrix products' strength);
* the cache's masking only: a key mask or a position-causal mask of (b, 1, t_q or 1, t_k), no
  additive bias (ALiBi, T5) and no slot-order causal flag, no dropout, no weights asked for, no
  gradient (the op has no backward).

A prefill chunk (more than ``MAX_QUERIES`` queries per row) keeps the gather + SDPA, through
``aiayn.fast.prefill_attention``: its mask turned into SDPA's additive form once per forward
rather than in every layer (the same computation; tests/consistency/test_prefill_attention.py).

Equal to the plain path up to float32 rounding: tests/consistency/test_paged_attention_kernel.py.
The step it speeds up: ``python -m benchmarks.kv_cache --paged`` (the "kernel" column).

Shape letters: b rows, h query heads, h_kv key/value heads, t_q new tokens, t_k keys read, d_h head width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.fast import prefill_attention, switch
from aiayn.fast.paged_attention_build import kernel_ops
from aiayn.nn.attention import AttentionInputs
from aiayn.nn.kv_cache import ROWS, LayerKVCache, StaticKV
from aiayn.nn.paged_kv_cache import PagedLayerKVCache

# Queries per row up to which the kernel replaces the gather + SDPA. It computes one query at a
# time (no matrix products), so it is for decode steps and short chunks
# (``python -m benchmarks.kv_cache --paged`` measures it).
MAX_QUERIES = 1


def applies(q: Tensor, cache: LayerKVCache | StaticKV | None, inputs: AttentionInputs) -> bool:
    """Whether ``paged_cache_attention`` takes this call (the conditions of the module docstring)."""
    if not isinstance(cache, PagedLayerKVCache) or cache.read_blocks is None or cache.read_run is not None:
        return False
    mask = inputs.mask
    return (switch.kernel_enabled("paged_attention") and q.device.type == "cpu" and q.dtype == torch.float32
            and cache.k.dtype == torch.float32 and q.dim() == 4 and q.shape[2] <= MAX_QUERIES
            and not q.requires_grad  # (the op has no backward: decoding runs without gradients)
            and inputs.bias is None and not inputs.causal
            and inputs.slots is not None and inputs.slots.kind == ROWS
            and (mask is None or (mask.dim() == 4 and mask.dtype == torch.bool and mask.shape[1] == 1
                                  and mask.shape[0] in (1, q.shape[0]) and mask.shape[2] in (1, q.shape[2])
                                  and mask.shape[3] == cache.read_end)))


def paged_cache_attention(q: Tensor, k: Tensor, v: Tensor, cache: LayerKVCache | StaticKV | None,
                          inputs: AttentionInputs, scale: float | None = None) -> Tensor | None:
    """Write k, v (b, h_kv, t_q, d_h) into ``cache`` and attend q (b, h, t_q, d_h) over its rows'
    keys in place: (b, h, t_q, d_h). A prefill chunk (more than ``MAX_QUERIES`` queries per row)
    takes ``aiayn.fast.prefill_attention`` instead (the gathered keys, its mask prepared once per
    forward). None (and nothing written) where neither applies: the caller then takes the plain path."""
    if prefill_attention.applies(q, cache, inputs, MAX_QUERIES):
        assert isinstance(cache, PagedLayerKVCache)  # (applies)
        return prefill_attention.prefill_cache_attention(q, k, v, cache, inputs, scale)
    if not applies(q, cache, inputs):
        return None
    ops = kernel_ops()
    if ops is None:
        return None
    assert isinstance(cache, PagedLayerKVCache) and cache.read_blocks is not None  # (applies)
    assert inputs.slots is not None  # (applies)
    cache.store(k, v, inputs.slots)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ops.attention(q, cache.k, cache.v, cache.read_blocks, cache.read_end, inputs.mask, scale)
