"""One attention layer's key/value storage, and where a forward writes into it (``Slots``).

Past keys and values never change, so a decoder stores them in buffers allocated once at full size
and written in place (no ``torch.cat`` growth); ``aiayn.nn.kv_cache`` reserves the slots.

Shape letters: b batch, h_kv key/value heads, s_max capacity, d_h head width.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.nn.kv_memory import QUANTIZED, SCALE_DTYPE, _check_group

RUN, ROWS, SLOT, ROW_SLOT = "run", "rows", "slot", "row_slot"


@dataclass(frozen=True)
class Slots:
    """Where one forward's new keys and values go in every layer, and which the write returns: [0, ``end``).
    ``kind``, the one thing a write dispatches on:

    * ``run``: every row's t new tokens at [start, start + t) (an aligned ``KVCache``: slices);
    * ``rows``: row i's at ``index[i]``, (b, t) long (a per-row ``KVCache``; ``PagedKVCache``'s pool slots);
    * ``slot``: every row's one new token at ``index``, (1,) long (the compiled step);
    * ``row_slot``: row i's one token at ``index[i, 0]``, (b, 1) long (the compiled per-row step: an
      indexed store, where a ``scatter_`` into a graph input compiles to a copy of the whole buffer).
    """

    kind: str
    end: int
    start: int = 0
    index: Tensor | None = None

    @staticmethod
    def run(start: int, t: int) -> Slots:
        return Slots(RUN, start + t, start=start)

    @staticmethod
    def rows(index: Tensor, end: int) -> Slots:
        return Slots(ROWS, end, index=index)

    @staticmethod
    def slot(index: Tensor, end: int) -> Slots:
        return Slots(SLOT, end, index=index)

    @staticmethod
    def row_slot(index: Tensor, end: int) -> Slots:
        return Slots(ROW_SLOT, end, index=index)

    @property
    def per_row(self) -> bool:
        """Each row at its own slots: causality comes from positions, not slot order."""
        return self.kind != RUN and self.kind != SLOT


def quantize_absmax(x: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric absmax quantisation of (..., d) in groups of ``group_size`` channels -> (q int8 (..., d)
    in [-qmax, qmax], scale float16 (..., d / group_size)), qmax = 2^(bits-1) - 1, x ~ q * scale: the
    error per element is at most scale / 2, plus the float16 rounding of the scale."""
    qmax = 2 ** (bits - 1) - 1
    groups = x.float().unflatten(-1, (-1, group_size))  # (..., n_groups, group)
    scale = (groups.abs().amax(dim=-1) / qmax).to(SCALE_DTYPE)  # (..., n_groups)
    safe = torch.where(scale == 0, 1.0, scale.float())[..., None]  # all-zero groups: q = 0
    q = torch.round(groups / safe).clamp_(-qmax, qmax).to(torch.int8).flatten(-2)
    return q, scale


def dequantize_absmax(q: Tensor, scale: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    """Inverse of ``quantize_absmax``: (..., d) int8, (..., d / group_size) -> (..., d) ``dtype``."""
    groups = q.unflatten(-1, (-1, group_size)).float() * scale.float()[..., None]
    return groups.flatten(-2).to(dtype)


def _pack_int4(q: Tensor) -> Tensor:
    """(..., d) int8 in [-7, 7] -> (..., d / 2) uint8, two offset-by-8 nibbles per byte."""
    u = (q + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack_int4(p: Tensor) -> Tensor:
    """(..., d / 2) uint8 -> (..., d) int8"""
    low, high = (p & 0x0F).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)


class LayerKVCache:
    """One self-attention layer's preallocated keys and values ``k``, ``v``, written by ``write``. Layouts:

    * **rows** (the constructor): (b, h_kv, s_max, d_h) each, row i's slot s at ``[i, :, s]``;
    * **a block pool** (``pool``): (n_blocks, B, h_kv, d_h) each. The paged cache's ``reserve`` sets the
      block table (``read_blocks``, (b, n)) and key extent (``read_end``); ``write`` stores the keys
      at their pool slots and gathers the rows' blocks (``aiayn.nn.paged_kv_cache``).

    Quantised ("int8", "int4"): k, v hold int8 codes (int4: two nibbles a byte, (b, h_kv, s_max, d_h / 2)
    uint8) and ``k_scale``/``v_scale`` (b, h_kv, s_max, d_h / group_size) float16 absmax scales, one per
    token, head and ``group_size`` channels: quantised on write, dequantised to the compute dtype on read.
    """

    k_scale: Tensor  # (quantised)
    v_scale: Tensor
    group_size: int
    bits: int
    # A block pool's: block size, the forward's block table and key extent, and for one row of
    # consecutive blocks the first id (its keys are a view of the pool). Rows: block_size 0.
    block_size = 0
    read_blocks: Tensor | None = None
    read_end = 0
    read_run: int | None = None
    # An encoder-decoder's cross-attention k, v (b, h_kv, s, d_h), projected by the first forward.
    cross: tuple[Tensor, Tensor] | None = None

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int, *,
                 quantize: str | None = None, group_size: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        self.quantize, self.dtype, self.max_len, self.head_dim = quantize, dtype, max_len, head_dim
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        if quantize is None:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
            self._row_buffers: tuple[str, ...] = ("k", "v")  # what a reorder or a row swap carries along
            return
        if quantize not in QUANTIZED:
            raise ValueError(f"unknown KV-cache quantisation {quantize!r}; use one of {', '.join(QUANTIZED)}")
        self.group_size = _check_group(head_dim, group_size, quantize)
        self.bits = 8 if quantize == "int8" else 4
        width = head_dim if quantize == "int8" else head_dim // 2
        data_dtype = torch.int8 if quantize == "int8" else torch.uint8
        self.k = torch.zeros((*shape[:3], width), dtype=data_dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale = torch.zeros((*shape[:3], head_dim // self.group_size), dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.zeros_like(self.k_scale)
        self._row_buffers = ("k", "v", "k_scale", "v_scale")

    @classmethod
    def pool(cls, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, *,
             dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> LayerKVCache:
        """A block-pool layer: k, v (n_blocks, block_size, h_kv, d_h), float."""
        layer = cls.__new__(cls)
        shape = (n_blocks, block_size, n_kv_heads, head_dim)
        layer.k = torch.zeros(shape, dtype=dtype, device=device)
        layer.v = torch.zeros(shape, dtype=dtype, device=device)
        layer.quantize, layer.dtype, layer.head_dim = None, dtype, head_dim
        layer.block_size, layer.max_len = block_size, n_blocks * block_size
        layer._row_buffers = ()  # no buffer is indexed by row: a view shares the pool
        return layer

    def write(self, k: Tensor, v: Tensor, slots: Slots) -> tuple[Tensor, Tensor]:
        """Store new k, v (b, h_kv, t, d_h) at ``slots`` (quantised: a run or rows); return [0, slots.end):
        views of the buffers, or dequantised copies (a block pool: the rows' blocks gathered)."""
        if self.block_size:
            self.store(k, v, slots)
            return self.gather()
        if self.quantize is not None and slots.kind != RUN and slots.kind != ROWS:
            raise ValueError("the static-shape (compiled) decode step needs a float KV cache; "
                             "decode a quantised cache without compile")
        if slots.kind == RUN:
            self._check_write(k, slots.start)
        elif slots.kind == ROW_SLOT and (slots.index is None or slots.index.shape != (k.shape[0], 1) or k.shape[2] != 1):
            raise ValueError("the compiled per-row step writes one token per row at its (b, 1) slots")
        end = slots.end
        if self.quantize is None:
            self._put(self.k, k, slots)
            self._put(self.v, v, slots)
            return self.k[:, :, :end], self.v[:, :, :end]
        for data, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_absmax(x, self.bits, self.group_size)
            self._put(data, q if self.bits == 8 else _pack_int4(q), slots)
            self._put(scales, scale, slots)
        self.dtype = k.dtype  # read back in the compute dtype
        return (self._load(self.k[:, :, :end], self.k_scale[:, :, :end]),
                self._load(self.v[:, :, :end], self.v_scale[:, :, :end]))

    def _put(self, buffer: Tensor, x: Tensor, slots: Slots) -> None:
        """Store x (b, h_kv, t, w) into ``buffer`` (b, h_kv, s_max, w) at ``slots``."""
        index = slots.index
        if slots.kind == RUN:
            buffer[:, :, slots.start: slots.end] = x
        elif slots.kind == ROWS:
            assert index is not None
            buffer.scatter_(2, self._row_index(x, index, buffer.shape[3]), x.to(buffer.dtype))  # (b, h_kv, t, w)
        elif slots.kind == SLOT:
            buffer.index_copy_(2, index, x.to(buffer.dtype))
        else:  # ROW_SLOT: an indexed store in place
            assert index is not None
            rows = torch.arange(x.shape[0], device=x.device)  # (b,)
            buffer[rows, :, index[:, 0]] = x[:, :, 0].to(buffer.dtype)  # (b, h_kv, w) into (b, h_kv, s_max, w)

    def _load(self, data: Tensor, scale: Tensor) -> Tensor:
        """Quantised codes and scales of some slots -> their keys or values in ``dtype``."""
        q = data if self.bits == 8 else _unpack_int4(data)
        return dequantize_absmax(q, scale, self.group_size, self.dtype)

    def _check_write(self, k: Tensor, pos: int) -> None:
        """Raise a clear error unless k (b, h_kv, t, d_h) fits at ``pos``."""
        t = k.shape[2]
        if pos + t > self.max_len:
            raise ValueError(f"KV cache is full: writing {t} token(s) at position {pos} needs {pos + t} slots, "
                             f"but the cache holds {self.max_len}; create the cache with a larger max_len")
        if k.shape[0] != self.k.shape[0] or k.shape[1] != self.k.shape[1] or k.shape[3] != self.head_dim:
            raise ValueError(f"KV cache was built for (batch, kv_heads, *, head_dim) = "
                             f"{(self.k.shape[0], self.k.shape[1], '*', self.head_dim)}, got k of shape {tuple(k.shape)}")

    def _row_index(self, k: Tensor, slots: Tensor, width: int) -> Tensor:
        """Per-row slots (b, t) -> the scatter index (b, h_kv, t, width) of new keys k (b, h_kv, t, d_h)."""
        if slots.shape != (k.shape[0], k.shape[2]) or k.shape[0] != self.k.shape[0]:
            raise ValueError(f"per-row cache slots of shape {tuple(slots.shape)} do not fit k of shape "
                             f"{tuple(k.shape)} and a cache of {self.k.shape[0]} rows")
        return slots[:, None, :, None].expand(-1, k.shape[1], -1, width)

    def store(self, k: Tensor, v: Tensor, slots: Slots) -> None:
        """A block pool's half of ``write``: store new k, v (b, h_kv, t, d_h) at pool slots ``slots.index``."""
        if slots.kind != ROWS or slots.index is None or self.read_blocks is None:
            raise ValueError("a paged KV cache layer is written through PagedKVCache.reserve's slots")
        b, h_kv, t, d_h = k.shape
        for pool, new in ((self.k, k), (self.v, v)):
            flat = pool.view(-1, h_kv, d_h)  # (n_blocks * B, h_kv, d_h)
            flat.index_copy_(0, slots.index.reshape(-1), new.transpose(1, 2).reshape(b * t, h_kv, d_h).to(pool.dtype))

    def gather(self) -> tuple[Tensor, Tensor]:
        """The rows' keys and values over slots [0, read_end), contiguous: 2 x (b, h_kv, read_end, d_h)."""
        assert self.read_blocks is not None, "gather() follows PagedKVCache.reserve"
        _, _, h_kv, d_h = self.k.shape
        b, n = self.read_blocks.shape
        if self.read_run is not None:  # b = 1, blocks [read_run, read_run + n): a view, no copy
            keys, values = (pool[self.read_run: self.read_run + n].view(1, n * self.block_size, h_kv, d_h)
                            [:, : self.read_end] for pool in (self.k, self.v))
            return keys.transpose(1, 2), values.transpose(1, 2)
        index = self.read_blocks.reshape(-1)  # (b * n,)
        keys, values = (pool.index_select(0, index).view(b, n * self.block_size, h_kv, d_h)[:, : self.read_end]
                        for pool in (self.k, self.v))  # (b, read_end, h_kv, d_h) each
        return keys.transpose(1, 2), values.transpose(1, 2)  # (b, h_kv, read_end, d_h)

    def rows(self, start: int, stop: int) -> LayerKVCache:
        """This layer as a view of rows [start, stop) sees it (``KVCache.rows``); a block pool: the same pool."""
        view = copy.copy(self)
        for name in self._row_buffers:
            setattr(view, name, getattr(self, name)[start:stop])
        return view

    def swap_rows(self, i: int, j: int, n: int) -> None:
        """Exchange the first n slots of rows i and j, in place (int indexing: no host-to-device copy)."""
        for name in self._row_buffers:
            buffer = getattr(self, name)  # (b, h_kv, s_max, d_h) or its scales
            swap_in_place(buffer[i, :, :n], buffer[j, :, :n])  # (h_kv, n, d_h) each

    def reorder(self, indices: Tensor, length: int) -> None:
        """Row i becomes old row ``indices[i]`` (b_new,); only the first ``length`` slots are copied."""
        b_new = indices.shape[0]
        for name in self._row_buffers:
            old = getattr(self, name)
            new = old.new_zeros((b_new, *old.shape[1:]))  # (b_new, h_kv, s_max, d_h)
            new[:, :, :length] = old[:, :, :length].index_select(0, indices)
            setattr(self, name, new)

    @property
    def nbytes(self) -> int:
        scales = (self.k_scale, self.v_scale) if self.quantize is not None else ()
        return sum(t.nbytes for t in (self.k, self.v, *scales))


def swap_in_place(a: Tensor, b: Tensor) -> None:
    """Exchange the contents of two same-shaped views, in place (device copies only)."""
    kept = a.clone()
    a.copy_(b)
    b.copy_(kept)
