"""Key/value caches for incremental decoding.

Self-attention keys and values of past tokens never change, so a decoder stores them instead of
recomputing them for every new token. The buffers here are allocated once at their full size and
written at a position: a decode step costs O(t_new) projections, with no ``torch.cat`` growth.

Shape letters: b batch, h_kv key/value heads (GQA/MQA cache only these), s_max capacity, d_h
head width.

Quantised caches (``quantize="int8"`` or ``"int4"``) store keys and values as integers with one
absmax scale per token, head and group of ``group_size`` channels (default: the whole head):
quantised on write, dequantised when the attention reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from aiayn.config import ModelConfig

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


QUANTIZED = ("int8", "int4")  # cache element types stored with per-group scales
SCALE_DTYPE = torch.float16  # the scales' type: 2 bytes per token, head and group


def kv_cache_bytes(*, n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch_size: int,
                   dtype: torch.dtype | str = torch.float32, group_size: int | None = None,
                   src_len: int = 0, cross_dtype: torch.dtype | str | None = None) -> int:
    """Memory of a KV cache: 2 (k and v) x layers x kv_heads x head_dim x seq_len x batch x bytes.

    Example (the seeds'): batch 32, 32 layers, 32 heads of 128 (d_model 4096), 2048 tokens,
    float32 -> 68,719,476,736 bytes = 64 GiB.

    ``dtype="int8"``/``"int4"`` is the quantised cache: 1 byte (int8) or half a byte (int4, two per
    byte) per element, plus a float16 scale per token, head and ``group_size`` channels (default:
    one per head) -- exactly what ``KVCache(quantize=...).nbytes`` holds.

    ``src_len`` > 0: a decoder of an encoder-decoder, whose every layer also keeps the
    cross-attention keys and values of the ``src_len`` source tokens (computed once from the
    encoder output): plus 2 x layers x kv_heads x head_dim x src_len x batch x bytes of
    ``cross_dtype`` (default: ``dtype``, or float32 for a quantised cache: they stay in float).
    """
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("seq_len", seq_len), ("batch_size", batch_size)):
        if value <= 0:
            raise ValueError(f"kv_cache_bytes: {name} must be positive, got {value}")
    if src_len < 0:
        raise ValueError(f"kv_cache_bytes: src_len must be >= 0, got {src_len}")
    vectors = 2 * n_layers * n_kv_heads * seq_len * batch_size  # (k or v) x token x head
    quantized = isinstance(dtype, str) and dtype in QUANTIZED
    if cross_dtype is None:
        cross_dtype = "float32" if quantized else dtype
    cross = 2 * n_layers * n_kv_heads * src_len * batch_size * head_dim * dtype_bytes(cross_dtype)
    if quantized:
        group = _check_group(head_dim, group_size, str(dtype))
        data = head_dim if dtype == "int8" else head_dim // 2
        return vectors * (data + (head_dim // group) * dtype_bytes(SCALE_DTYPE)) + cross
    return vectors * head_dim * dtype_bytes(dtype) + cross


def _check_group(head_dim: int, group_size: int | None, quantize: str) -> int:
    group = head_dim if group_size is None else group_size
    if group <= 0 or head_dim % group != 0:
        raise ValueError(f"group_size={group_size} must divide head_dim={head_dim}")
    if quantize == "int4" and head_dim % 2 != 0:
        raise ValueError(f"an int4 KV cache packs two values per byte and needs an even head_dim, "
                         f"got {head_dim}; use quantize='int8'")
    return group


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

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    # Per-row writes (a (b, t) ``pos``) return slots [0, row_extent): ``RowKVCache.reserve`` sets it
    # from its host lengths before the layers write. None: the extent is read from ``pos`` (a read
    # of a device value: a wait on a GPU, a graph break under torch.compile).
    row_extent: int | None = None

    def write(self, k: Tensor, v: Tensor, pos: int | Tensor) -> tuple[Tensor, Tensor]:
        """Store new k, v (b, h_kv, t, d_h) at [pos, pos + t); return views of [0, pos + t).

        ``pos`` may be a (t,) long tensor of slots instead (the decode step that ``torch.compile``
        runs, see ``aiayn.fast.compiled_decode``): k, v go there and the whole buffers come back,
        (b, h_kv, s_max, d_h); the caller attends over the filled prefix its key mask covers.
        A (b, t) tensor gives each row its own slots (``RowKVCache``): views of
        [0, the highest slot + 1) come back (``row_extent`` when set: the same number, known on
        the host).
        """
        if isinstance(pos, Tensor) and pos.dim() == 2:
            index = self._row_index(k, pos, self.k.shape[3])  # (b, h_kv, t, d_h)
            self.k.scatter_(2, index, k.to(self.k.dtype))
            self.v.scatter_(2, index, v.to(self.v.dtype))
            end = self._extent(pos)
            return self.k[:, :, :end], self.v[:, :, :end]
        if isinstance(pos, Tensor):
            self.k.index_copy_(2, pos, k.to(self.k.dtype))
            self.v.index_copy_(2, pos, v.to(self.v.dtype))
            return self.k, self.v
        t = self._check_write(k, pos, head_dim=self.k.shape[3])
        self.k[:, :, pos : pos + t] = k
        self.v[:, :, pos : pos + t] = v
        return self.k[:, :, : pos + t], self.v[:, :, : pos + t]

    def _check_write(self, k: Tensor, pos: int, *, head_dim: int) -> int:
        """Raise a clear error unless k (b, h_kv, t, d_h) fits at ``pos``; return t."""
        t = k.shape[2]
        if pos + t > self.max_len:
            raise ValueError(
                f"KV cache is full: writing {t} token(s) at position {pos} needs {pos + t} slots, "
                f"but the cache holds {self.max_len}; create the cache with a larger max_len"
            )
        if k.shape[0] != self.k.shape[0] or k.shape[1] != self.k.shape[1] or k.shape[3] != head_dim:
            raise ValueError(
                f"KV cache was built for (batch, kv_heads, *, head_dim) = "
                f"{(self.k.shape[0], self.k.shape[1], '*', head_dim)}, got k of shape {tuple(k.shape)}"
            )
        return t

    def _extent(self, slots: Tensor) -> int:
        """The slots [0, extent) a per-row write of ``slots`` (b, t) returns: the highest slot + 1."""
        return self.row_extent if self.row_extent is not None else int(slots.max()) + 1

    def _row_index(self, k: Tensor, slots: Tensor, width: int) -> Tensor:
        """Per-row slots (b, t) -> the scatter index (b, h_kv, t, width) of new keys k (b, h_kv, t, d_h)."""
        if slots.shape != (k.shape[0], k.shape[2]) or k.shape[0] != self.k.shape[0]:
            raise ValueError(f"per-row cache slots of shape {tuple(slots.shape)} do not fit k of shape "
                             f"{tuple(k.shape)} and a cache of {self.k.shape[0]} rows")
        return slots[:, None, :, None].expand(-1, k.shape[1], -1, width)

    # Per-row buffers a reorder must carry along (a quantised cache adds its scales).
    _row_buffers: tuple[str, ...] = ("k", "v")

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
        return self.k.nbytes + self.v.nbytes


def quantize_absmax(x: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric absmax quantisation of (..., d) in groups of ``group_size`` channels.

    Returns (q int8 (..., d) in [-qmax, qmax], scale float16 (..., d / group_size)) with
    qmax = 2^(bits-1) - 1, so that x ~ q * scale; the error per element is at most scale / 2
    (plus the float16 rounding of the scale, relative 2^-11 while the scale is a normal float16,
    i.e. for groups whose absmax exceeds about 0.008 (int8); smaller ones are still bounded by
    half a step of the rounded scale plus 6e-8 * qmax).
    """
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


class QuantizedLayerKVCache(LayerKVCache):
    """A ``LayerKVCache`` holding int8 (or packed int4) keys and values with float16 absmax scales.

    Keys and values are quantised as they are written (one scale per token, head and group of
    ``group_size`` channels) and the prefix read back is dequantised to ``dtype``, so attention runs
    in float on values that carry the quantisation error. Storage per token and head:
    d_h (int8) or d_h / 2 (int4) bytes, plus 2 bytes per group.
    """

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int, *,
                 quantize: str = "int8", group_size: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        if quantize not in QUANTIZED:
            raise ValueError(f"unknown KV-cache quantisation {quantize!r}; use one of {', '.join(QUANTIZED)}")
        self.group_size = _check_group(head_dim, group_size, quantize)
        self.quantize, self.bits, self.dtype = quantize, 8 if quantize == "int8" else 4, dtype
        width = head_dim if quantize == "int8" else head_dim // 2
        data_dtype = torch.int8 if quantize == "int8" else torch.uint8
        # k/v hold the integer codes; the shape checks of ``write`` read only dims 0, 1 (and 3 for int8).
        self.k = torch.zeros((batch_size, n_kv_heads, max_len, width), dtype=data_dtype, device=device)
        self.v = torch.zeros_like(self.k)
        scales = (batch_size, n_kv_heads, max_len, head_dim // self.group_size)
        self.k_scale = torch.zeros(scales, dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.zeros_like(self.k_scale)
        self.max_len, self.head_dim = max_len, head_dim

    _row_buffers = ("k", "v", "k_scale", "v_scale")

    def _store(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q, scale = quantize_absmax(x, self.bits, self.group_size)
        return (q if self.bits == 8 else _pack_int4(q)), scale

    def _load(self, data: Tensor, scale: Tensor) -> Tensor:
        q = data if self.bits == 8 else _unpack_int4(data)
        return dequantize_absmax(q, scale, self.group_size, self.dtype)

    def write(self, k: Tensor, v: Tensor, pos: int | Tensor) -> tuple[Tensor, Tensor]:
        """Quantise new k, v (b, h_kv, t, d_h) into [pos, pos + t); return [0, pos + t) dequantised."""
        if isinstance(pos, Tensor) and pos.dim() == 2:  # per-row slots (b, t), see LayerKVCache.write
            self.dtype = k.dtype
            data_index = self._row_index(k, pos, self.k.shape[3])  # (b, h_kv, t, d_h or d_h / 2)
            scale_index = self._row_index(k, pos, self.k_scale.shape[3])  # (b, h_kv, t, groups)
            for data, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                q, scale = self._store(x)
                data.scatter_(2, data_index, q)
                scales.scatter_(2, scale_index, scale)
            end = self._extent(pos)
            return (self._load(self.k[:, :, :end], self.k_scale[:, :, :end]),
                    self._load(self.v[:, :, :end], self.v_scale[:, :, :end]))
        if isinstance(pos, Tensor):
            raise ValueError("the static-shape (compiled) decode step needs a float KV cache; "
                             "decode a quantised cache without compile")
        t = self._check_write(k, pos, head_dim=self.head_dim)
        self.dtype = k.dtype  # read back in the compute dtype
        end = pos + t
        self.k[:, :, pos:end], self.k_scale[:, :, pos:end] = self._store(k)
        self.v[:, :, pos:end], self.v_scale[:, :, pos:end] = self._store(v)
        return (self._load(self.k[:, :, :end], self.k_scale[:, :, :end]),
                self._load(self.v[:, :, :end], self.v_scale[:, :, :end]))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes


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

    ``quantize="int8"`` or ``"int4"`` stores the self-attention keys and values quantised
    (``QuantizedLayerKVCache``; scales per token, head and ``group_size`` channels); the
    cross-attention keys and values, computed once, stay in float.
    """

    def __init__(self, *, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, cross_attention: bool = False,
                 quantize: str | None = None, group_size: int | None = None) -> None:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(
                f"KVCache needs positive batch_size and max_len, got {batch_size} and {max_len}"
            )
        self.layers: list[LayerKVCache]
        if quantize is None:
            self.layers = [
                LayerKVCache(batch_size, n_kv_heads, head_dim, max_len, dtype=dtype, device=device)
                for _ in range(n_layers)
            ]
        else:
            self.layers = [
                QuantizedLayerKVCache(batch_size, n_kv_heads, head_dim, max_len, quantize=quantize,
                                      group_size=group_size, dtype=dtype, device=device)
                for _ in range(n_layers)
            ]
        self.quantize = quantize
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
    def self_nbytes(self) -> int:
        """Bytes of the self-attention key/value buffers (allocated at creation)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def cross_nbytes(self) -> int:
        """Bytes of the cross-attention keys/values (encoder-decoder; 0 until the first decode step
        computes them from the encoder output)."""
        return sum(kv.nbytes for kv in self.cross)

    @property
    def nbytes(self) -> int:
        """Bytes held now: self-attention buffers plus any cross-attention keys/values (what
        ``kv_cache_bytes`` estimates, with ``src_len`` the source length)."""
        return self.self_nbytes + self.cross_nbytes


# ---- the memory estimate, described (``aiayn kv-cache``) ----------------------------------------
def cache_sizes(config: ModelConfig) -> dict[str, int]:
    """The sizes a model's KV cache is made of: n_layers (its decoder's), n_heads, n_kv_heads,
    d_model, head_dim, seq_len (the model's max_seq_len) and src_len (an encoder-decoder's source
    length for the cross-attention keys/values: max_seq_len too; 0 for other models)."""
    n_layers = config.n_decoder_layers if config.arch != "encoder-only" else config.n_layers
    return {"n_layers": n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
            "d_model": config.d_model, "head_dim": config.head_dim, "seq_len": config.max_seq_len,
            "src_len": config.max_seq_len if config.arch == "encoder-decoder" else 0}


def describe_kv_cache(*, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int,
                      batch_size: int, dtype: str = "float32", group_size: int | None = None,
                      src_len: int = 0) -> list[str]:
    """``kv_cache_bytes`` as lines to print: the total, the product it comes from (self-attention,
    and cross-attention when ``src_len`` > 0), and what float32 (for a quantised cache) or
    multi-head attention (for GQA/MQA) would need instead.
    ValueError (from ``kv_cache_bytes``) for a group_size that does not fit."""
    sizes = dict(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, seq_len=seq_len,
                 batch_size=batch_size)
    total = kv_cache_bytes(**sizes, dtype=dtype, group_size=group_size, src_len=src_len)
    own = kv_cache_bytes(**sizes, dtype=dtype, group_size=group_size)  # self-attention only
    lines = [f"KV cache: {format_bytes(total)} ({total:,} bytes)"]
    if src_len:
        lines.append(f"  self-attention: {format_bytes(own)} ({own:,} bytes)")
    vectors = f"2 (k, v) x {n_layers} layers x {n_kv_heads} kv heads x {seq_len} tokens x {batch_size} batch"
    if dtype in QUANTIZED:
        groups = head_dim // (group_size or head_dim)
        data = f"{head_dim}" if dtype == "int8" else f"{head_dim} / 2"
        lines.append(f"  = {vectors} x ({data} bytes of {dtype} + {groups} x 2 bytes of float16 scales)")
    else:
        lines.append(f"  = 2 (k, v) x {n_layers} layers x {n_kv_heads} kv heads x {head_dim} head_dim "
                     f"x {seq_len} tokens x {batch_size} batch x {dtype_bytes(dtype)} bytes ({dtype})")
    if src_len:
        cross_dtype = "float32" if dtype in QUANTIZED else dtype
        cross = total - own
        lines.append(f"  cross-attention (encoder-decoder): {format_bytes(cross)} ({cross:,} bytes)")
        lines.append(f"  = 2 (k, v) x {n_layers} layers x {n_kv_heads} kv heads x {head_dim} head_dim "
                     f"x {src_len} source tokens x {batch_size} batch x {dtype_bytes(cross_dtype)} bytes "
                     f"({cross_dtype}, computed once from the encoder output)")
    if dtype in QUANTIZED:
        full = kv_cache_bytes(**sizes, dtype="float32", src_len=src_len)
        lines.append(f"  float32 would need {format_bytes(full)} ({full / total:.2f}x)")
    if n_kv_heads != n_heads:
        lines.append(f"  multi-head attention with {n_heads} kv heads would need "
                     f"{format_bytes(total * n_heads // n_kv_heads)}")
    return lines
