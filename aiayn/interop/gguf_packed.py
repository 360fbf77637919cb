"""A GGUF LLaMA with its matrices in blocks (``load_gguf(path, quantize=...)``): built on the meta device,
each matrix becomes a ``BlockLinear`` / ``BlockEmbedding`` of the file's integers and scales, the rest is
dequantised. ``"q4"`` re-quantises wider types with Q4_1's scheme; no float copy of a matrix is made."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.fast.q4 import BlockEmbedding, BlockLinear, BlockWeight, quantize_blocks_q4
from aiayn.interop.gguf_blocks import SUPPORTED as BLOCK_TYPES
from aiayn.interop.gguf_blocks import unpack
from aiayn.interop.gguf_tensors import (
    float_tensor,
    hf_name,
    rope_heads,
    torch_shape,
    unpermute_rope_rows,
)
from aiayn.interop.gguf_text import GGUFError
from aiayn.interop.hf import family_for, from_hf_state
from aiayn.models.size import available_memory
from aiayn.nn.positional import RotaryEmbedding

if TYPE_CHECKING:
    from gguf import ReaderTensor

MODES = ("auto", "q4")
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")  # nibbles: kept as they are by "q4"


def _blocks_of(tensor: ReaderTensor, hf_config: dict[str, Any], mode: str) -> BlockWeight:
    """One GGUF matrix as a BlockWeight (rows in Hugging Face's order)."""
    rows, k = torch_shape(tensor)
    heads = rope_heads(tensor.name, hf_config)
    kind = tensor.tensor_type.name
    if kind in BLOCK_TYPES and (mode == "auto" or kind in FOUR_BIT_TYPES):
        data = np.asarray(tensor.data).reshape(rows, -1)
        # Unpacked a slice of rows at a time: a whole table at once would briefly take ~3x its size.
        step = rows if heads is not None else max(16, (1 << 22) // k // 16 * 16)  # whole 16-row groups
        out: BlockWeight | None = None
        for r0 in range(0, rows, step):
            u = unpack(kind, data[r0:r0 + step], min(step, rows - r0), k)
            values, scale = torch.from_numpy(np.ascontiguousarray(u.values)), torch.from_numpy(u.scale.copy())
            mins = None if u.mins is None else torch.from_numpy(u.mins.copy())
            if heads is not None:
                values, scale = unpermute_rope_rows(values, heads), unpermute_rope_rows(scale, heads)
                mins = None if mins is None else unpermute_rope_rows(mins, heads)
            part = BlockWeight.from_values(values, scale, mins, offset=u.offset, block=u.block, kind=kind)
            if out is None:
                if step >= rows:
                    return part
                out = _empty_like_rows(part, rows)
            g0 = r0 // 16
            for dst, src in ((out.q, part.q), (out.scale, part.scale), (out.mins, part.mins)):
                if dst is not None and src is not None:
                    dst[g0:g0 + src.shape[0]] = src
        assert out is not None
        return out
    return quantize_blocks_q4(float_tensor(tensor, hf_config))


def _release_pages(tensor: ReaderTensor) -> None:
    """Drop the file pages a tensor was read through from memory (``MADV_DONTNEED``); best effort."""
    import mmap

    array, base = tensor.data, tensor.data
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    mapped = getattr(base, "_mmap", None)
    if mapped is None or not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = array.ctypes.data - np.frombuffer(mapped, np.uint8).ctypes.data  # bytes into the mapping
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(start + array.nbytes, len(mapped))
    if 0 <= first < end:
        mapped.madvise(mmap.MADV_DONTNEED, first, end - first)


def _empty_like_rows(part: BlockWeight, rows: int) -> BlockWeight:
    def grown(t: Tensor) -> Tensor:
        return torch.empty((-(-rows // 16), t.shape[1]), dtype=t.dtype)

    return BlockWeight(grown(part.q), grown(part.scale), None if part.mins is None else grown(part.mins),
                       part.offset, part.block, part.nibbles, rows, part.k, part.kind)


def _stack(parts: list[BlockWeight]) -> BlockWeight:
    """Row-wise concatenation; parts of different formats meet in one that holds each exactly."""
    if len(parts) == 1:
        return parts[0]
    block, offset = min(p.block for p in parts), max(p.offset for p in parts)
    nibbles = all(p.nibbles for p in parts) and len({p.offset for p in parts}) == 1
    values, scales, mins = [], [], []
    for p in parts:
        scale, m = p.row_scales()
        values.append(p.values().to(torch.int16) + (offset - p.offset))
        scales.append(scale.repeat_interleave(p.block // block, dim=1))
        m = torch.zeros_like(scale) if m is None else m
        mins.append(m.repeat_interleave(p.block // block, dim=1))
    any_mins = any(p.mins is not None for p in parts)
    kind = "+".join(dict.fromkeys(p.kind for p in parts))
    return BlockWeight.from_values(torch.cat(values), torch.cat(scales), torch.cat(mins) if any_mins else None,
                                   offset=offset, block=block, kind=kind, nibbles=nibbles)


def packed_llama(tensors: Sequence[ReaderTensor], hf_config: dict[str, Any], source: str,
                 mode: str) -> tuple[nn.Module, ModelConfig]:
    if mode not in MODES:
        raise ValueError(f"quantize={mode!r}; packed GGUF loading takes one of {', '.join(MODES)}")
    packed_bytes = sum(int(t.n_bytes) for t in tensors)  # what the blocks take (K-quants' integers a little more)
    available = available_memory()
    if available is not None and packed_bytes > available:
        raise GGUFError(f"{source}: its {packed_bytes / 2**30:,.1f} GiB of weights do not fit in the "
                        f"{available / 2**30:,.1f} GiB of memory available here")
    by_name = {hf_name(t.name): t for t in tensors if hf_name(t.name) is not None}
    meta = {name: torch.empty(torch_shape(t), device="meta") for name, t in by_name.items()}
    with torch.device("meta"):
        model, config = from_hf_state(hf_config, meta, source=source)

    family = family_for(hf_config, source=source)
    for rule in family.rules(config):
        path, _, attr = rule.ours.rpartition(".")
        module = model.get_submodule(path)
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        is_matrix = attr == "weight" and isinstance(module, (nn.Linear, nn.Embedding))
        if is_matrix and _packable(module, [by_name[s] for s in rule.theirs], mode):
            weight = _stack([_blocks_of(by_name[s], hf_config, mode) for s in rule.theirs])
            for s in rule.theirs:
                _release_pages(by_name[s])
            setattr(parent, child, BlockEmbedding(weight) if isinstance(module, nn.Embedding) else BlockLinear(weight))
        elif isinstance(module, BlockLinear) and attr == "bias":
            module.bias = torch.cat([float_tensor(by_name[s], hf_config) for s in rule.theirs])
        else:
            value = torch.cat([float_tensor(by_name[s], hf_config) for s in rule.theirs])
            module._parameters[attr] = nn.Parameter(value)
    _tie_output(model, config)
    _rebuild_rotary(model, config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise GGUFError(f"{source}: aiayn could not fill {', '.join(left[:3])} from the file (an internal error)")
    return model.eval(), config


def _packable(module: nn.Module, parts: list[ReaderTensor], mode: str) -> bool:
    """Whether a matrix goes into blocks of 32 ("auto": all parts quantised; "q4": always)."""
    width = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
    if width % 32:
        return False
    return mode == "q4" or all(p.tensor_type.name in BLOCK_TYPES for p in parts)


def _tie_output(model: nn.Module, config: ModelConfig) -> None:
    """A tied output layer shares the embedding's blocks (or, float, its parameter again)."""
    if not config.tie_output:
        return
    embedding = model.decoder.embedding
    if isinstance(embedding, BlockEmbedding):
        model.lm_head = BlockLinear(embedding.weight_blocks)
    else:
        model.lm_head.weight = embedding.weight


def _rebuild_rotary(model: nn.Module, config: ModelConfig) -> None:
    """RoPE's cos/sin tables were computed on the meta device: compute them for real."""
    for name, module in list(model.named_modules()):
        if isinstance(module, RotaryEmbedding) and module.cos.is_meta:
            parent_path, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, child, RotaryEmbedding(config.head_dim, config.max_seq_len, base=config.rope_base))
