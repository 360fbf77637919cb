"""Key/value caches for incremental decoding.

Self-attention keys and values of past tokens never change, so a decoder stores them instead of
recomputing them for every new token. The buffers here are allocated once at their full size and
written at a position: a decode step costs O(t_new) projections, with no ``torch.cat`` growth.

Shape letters: b batch, h_kv key/value heads (GQA/MQA cache only these), s_max capacity, d_h
head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
          "bfloat16": 2, "bf16": 2, "float64": 8, "int8": 1}


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a dtype given as ``torch.float32`` or a name like "float32"/"bf16"."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    try:
        return _BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_BYTES))}") from None


def kv_cache_bytes(
    *,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch_size: int,
    dtype: torch.dtype | str = torch.float32,
) -> int:
    """Memory of a KV cache: 2 (k and v) x layers x kv_heads x head_dim x seq_len x batch x bytes.

    Example (the seeds'): batch 32, 32 layers, 32 heads of 128 (d_model 4096), 2048 tokens,
    float32 -> 68,719,476,736 bytes = 64 GiB.
    """
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("seq_len", seq_len), ("batch_size", batch_size)):
        if value <= 0:
            raise ValueError(f"kv_cache_bytes: {name} must be positive, got {value}")
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size * dtype_bytes(dtype)


def format_bytes(n: int) -> str:
    """1024-based human size: 68719476736 -> '64 GiB', 1536 -> '1.50 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if value == int(value) else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class LayerKVCache:
    """One self-attention layer's preallocated keys and values, (b, h_kv, s_max, d_h) each."""

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def write(self, k: Tensor, v: Tensor, pos: int) -> tuple[Tensor, Tensor]:
        """Store new k, v (b, h_kv, t, d_h) at [pos, pos + t); return views of [0, pos + t)."""
        t = k.shape[2]
        if pos + t > self.max_len:
            raise ValueError(
                f"KV cache is full: writing {t} token(s) at position {pos} needs {pos + t} slots, "
                f"but the cache holds {self.max_len}; create the cache with a larger max_len"
            )
        if k.shape[0] != self.k.shape[0] or k.shape[1] != self.k.shape[1] or k.shape[3] != self.k.shape[3]:
            raise ValueError(
                f"KV cache was built for (batch, kv_heads, *, head_dim) = "
                f"{(self.k.shape[0], self.k.shape[1], '*', self.k.shape[3])}, got k of shape {tuple(k.shape)}"
            )
        self.k[:, :, pos : pos + t] = k
        self.v[:, :, pos : pos + t] = v
        return self.k[:, :, : pos + t], self.v[:, :, : pos + t]

    def reorder(self, indices: Tensor, length: int) -> None:
        """Row i becomes old row ``indices[i]`` (b_new,); only the first ``length`` slots are copied."""
        b_new = indices.shape[0]
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((b_new, *old.shape[1:]))  # (b_new, h_kv, s_max, d_h)
            new[:, :, :length] = old[:, :, :length].index_select(0, indices)
            setattr(self, name, new)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class StaticKV:
    """Cross-attention keys and values of one layer: computed once from the encoder output."""

    k: Tensor | None = None
    v: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.nbytes + self.v.nbytes


class KVCache:
    """A whole model's decoding state: per-layer buffers plus what every layer shares.

    ``length`` counts the slots filled so far (prompt + generated, padding included).
    ``valid`` (b, s_max) marks slots holding real tokens (False for padding), and ``positions``
    (b, s_max) the position id of each slot, so later steps can mask padded keys and compute
    relative-position biases without the earlier tokens. ``cross`` holds one ``StaticKV`` per
    decoder layer of an encoder-decoder.
    """

    def __init__(
        self,
        *,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        cross_attention: bool = False,
    ) -> None:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(
                f"KVCache needs positive batch_size and max_len, got {batch_size} and {max_len}"
            )
        self.layers = [
            LayerKVCache(batch_size, n_kv_heads, head_dim, max_len, dtype=dtype, device=device)
            for _ in range(n_layers)
        ]
        self.cross = [StaticKV() for _ in range(n_layers)] if cross_attention else []
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.length = 0
        self.batch_size, self.max_len = batch_size, max_len

    def reserve(self, new_valid: Tensor, new_positions: Tensor) -> int:
        """Record t new slots (their validity and positions, (b, t)); return their start slot.

        The model calls this once per forward, before its layers write their keys and values.
        """
        start, t = self.length, new_valid.shape[1]
        if start + t > self.max_len:
            raise ValueError(
                f"KV cache is full: {start} slot(s) used + {t} new token(s) > max_len={self.max_len}; "
                f"create the cache with a larger max_len"
            )
        if new_valid.shape[0] != self.batch_size:
            raise ValueError(
                f"KV cache was created for batch_size={self.batch_size}, got a batch of {new_valid.shape[0]}"
            )
        self.valid[:, start : start + t] = new_valid
        self.positions[:, start : start + t] = new_positions
        self.length = start + t
        return start

    def next_positions(self) -> Tensor:
        """(b,) the position id the next real token of each row gets (real tokens so far)."""
        return self.valid[:, : self.length].sum(dim=1)

    def reorder(self, indices: Tensor, *, cross: bool = True) -> None:
        """Select, reorder or repeat batch rows: new row i is old row ``indices[i]``.

        ``indices`` (b_new,) long, any b_new >= 1, repeats allowed. Applies to every layer's
        self-attention keys/values, ``valid``, ``positions`` and (with ``cross``) the
        cross-attention keys/values. Beam search uses it to expand each source to its beams
        (``repeat_interleave``), to follow the beams it keeps at every step and to drop finished
        sources. ``cross=False`` leaves the cross-attention keys/values as they are: correct only
        when every row is replaced by a row with the same source (beams of one source share them),
        and it saves copying them.
        """
        if indices.dim() != 1 or indices.dtype != torch.long or indices.numel() == 0:
            raise ValueError(f"reorder needs a non-empty 1-D long tensor of row indices, got "
                             f"{indices.dtype} of shape {tuple(indices.shape)}")
        if int(indices.min()) < 0 or int(indices.max()) >= self.batch_size:
            raise ValueError(f"reorder: row index out of range for a cache of batch_size={self.batch_size}")
        indices = indices.to(self.valid.device)
        for layer in self.layers:
            layer.reorder(indices, self.length)
        self.valid = self.valid.index_select(0, indices)
        self.positions = self.positions.index_select(0, indices)
        if cross:
            for kv in self.cross:
                if kv.k is not None and kv.v is not None:
                    kv.k, kv.v = kv.k.index_select(0, indices), kv.v.index_select(0, indices)
        self.batch_size = indices.shape[0]

    def repeat_interleave(self, n: int) -> None:
        """Each row repeated n times in place (b -> b * n rows, copies of one row adjacent)."""
        self.reorder(torch.arange(self.batch_size, device=self.valid.device).repeat_interleave(n))

    def reset(self) -> None:
        """Forget all tokens (buffers stay allocated)."""
        self.length = 0
        self.valid.zero_()
        for cross in self.cross:
            cross.k = cross.v = None

    @property
    def nbytes(self) -> int:
        """Bytes of the self-attention key/value buffers (what ``kv_cache_bytes`` estimates)."""
        return sum(layer.nbytes for layer in self.layers)
