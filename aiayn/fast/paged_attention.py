"""Attention straight from a paged KV cache's blocks: ``paged_attention.cpp`` (vLLM's PagedAttention on
the CPU, in miniature) reads the keys and values in place through the block table, for float32
block-table reads of at most ``MAX_QUERIES`` new tokens per row, the cache's masking only.

Shape letters: b rows, h query heads, h_kv key/value heads, t_q new tokens, t_k keys read, d_h head width."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.fast import prefill_attention, switch
from aiayn.fast.paged_attention_build import kernel_ops
from aiayn.nn.attention import AttentionInputs
from aiayn.nn.kv_layer import LayerKVCache

# Queries per row up to which the kernel (one query at a time, no matrix products) replaces SDPA.
MAX_QUERIES = 1


def applies(q: Tensor, cache: LayerKVCache | tuple[Tensor, Tensor] | None, inputs: AttentionInputs) -> bool:
    """Whether ``paged_cache_attention`` takes this call (the module docstring's conditions)."""
    return (isinstance(cache, LayerKVCache) and cache.read_run is None
            and prefill_attention.reads_rows(q, cache, inputs)
            and switch.kernel_enabled("paged_attention") and q.dtype == torch.float32
            and cache.k.dtype == torch.float32 and q.shape[2] <= MAX_QUERIES
            and not q.requires_grad)  # (the op has no backward: decoding runs without gradients)


def paged_cache_attention(q: Tensor, k: Tensor, v: Tensor, cache: LayerKVCache | tuple[Tensor, Tensor] | None,
                          inputs: AttentionInputs, scale: float | None = None) -> Tensor | None:
    """Write k, v (b, h_kv, t_q, d_h) into ``cache`` and attend q (b, h, t_q, d_h) over its rows' keys
    in place (a longer chunk: ``prefill_attention``). None, nothing written, where neither applies."""
    if prefill_attention.applies(q, cache, inputs, MAX_QUERIES):
        assert isinstance(cache, LayerKVCache)  # (applies)
        return prefill_attention.prefill_cache_attention(q, k, v, cache, inputs, scale)
    if not applies(q, cache, inputs):
        return None
    ops = kernel_ops()
    if ops is None:
        return None
    assert isinstance(cache, LayerKVCache) and cache.read_blocks is not None  # (applies)
    assert inputs.slots is not None  # (applies)
    cache.store(k, v, inputs.slots)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ops.attention(q, cache.k, cache.v, cache.read_blocks, cache.read_end, inputs.mask, scale)
