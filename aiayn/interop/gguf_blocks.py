"""GGUF's quantised blocks, unpacked (not dequantised) into aiayn's block format (``aiayn.fast.q4``):
``w = scale * (q - offset) + min`` per block of 16 or 32 inputs, q unsigned. Every type maps onto it exactly
(float32 scales as ggml computes them), so ``BlockWeight.dequantize_rows()`` equals ``gguf.quants.dequantize``
bit for bit. ggml's formulas: Q4_0 d(q - 8), Q5_0 d(q - 16), Q4_1 and Q5_1 dq + m, Q8_0 dq (q signed, stored
q + 128), Q2_K, Q4_K and Q5_K d·sc·q - dmin·m, Q3_K d(sc - 32)(q - 4), Q6_K d·sc(q - 32).
Bit layouts follow ``gguf.quants``. Shape letters: r rows, n blocks per row, k inputs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

QK_K = 256
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
_BIT_SHIFTS = np.arange(8, dtype=np.uint8).reshape(8, 1)


@dataclass
class Unpacked:
    """One matrix's blocks: values (r, k) uint8, scale and mins (r, k / block) float32."""

    values: np.ndarray
    scale: np.ndarray
    mins: np.ndarray | None
    offset: int
    block: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 little-endian halves -> (...) float32 (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_16(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32): low nibbles are inputs 0..15, high nibbles 16..31 (Q4_0/Q4_1/Q5)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits_32(qh: np.ndarray) -> np.ndarray:
    """(..., 4) bytes, a little-endian uint32 -> (..., 32) its bits, bit j for input j."""
    word = np.ascontiguousarray(qh).view("<u4")  # (..., 1)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _crumbs(x: np.ndarray) -> np.ndarray:
    """(r, n, 64) bytes -> (r, n, 256) 2-bit values: bits 2j..2j+1 of byte i (of each 32) come j-th."""
    return ((x.reshape(*x.shape[:2], 2, 1, 32) >> _CRUMB_SHIFTS) & 3).reshape(*x.shape[:2], 256)


def _bit_planes(x: np.ndarray) -> np.ndarray:
    """(r, n, 32) bytes -> (r, n, 256) bits: bit j of byte i is input 32 j + i."""
    return ((x.reshape(*x.shape[:2], 1, 32) >> _BIT_SHIFTS) & 1).reshape(*x.shape[:2], 256)


def _blocks(data: np.ndarray, rows: int, k: int, block_elems: int, block_bytes: int, name: str) -> np.ndarray:
    if k % block_elems or data.shape != (rows, k // block_elems * block_bytes):
        raise ValueError(f"{name}: {data.shape} bytes do not hold {rows} rows of {k} inputs in blocks of "
                         f"{block_elems} ({block_bytes} bytes)")
    return data.reshape(rows, k // block_elems, block_bytes)


def unpack(kind: str, data: np.ndarray, rows: int, k: int) -> Unpacked:
    """GGUF blocks of ``kind``, raw bytes (rows, bytes per row), as integers and float32 scales."""
    data = np.asarray(data, dtype=np.uint8)
    if kind not in SUPPORTED:
        raise ValueError(f"{kind} blocks are not supported; aiayn packs {', '.join(SUPPORTED)}")
    return SUPPORTED[kind](data, rows, k)


def _q4_q5(kind: str, data: np.ndarray, rows: int, k: int) -> Unpacked:
    """Q4_0, Q4_1, Q5_0, Q5_1 blocks of 32: f16 d, [f16 m,] [32 high bits (Q5),] 16 bytes of nibbles."""
    five, has_min = kind[1] == "5", kind[3] == "1"
    head = 4 if has_min else 2
    b = _blocks(data, rows, k, 32, head + 4 * five + 16, kind)
    q = _nibbles_16(b[..., head + 4 * five:])
    if five:
        q = q | (_bits_32(b[..., head:head + 4]) << 4)
    mins = _f16(b[..., 2:4]) if has_min else None
    offset = 0 if has_min else 1 << (3 + five)  # _0 kinds centre their codes: 8 (4 bits) or 16 (5 bits)
    return Unpacked(q.reshape(rows, k), _f16(b[..., 0:2]), mins, offset, 32)


def _q8_0(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, 32, 34, "Q8_0")
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Unpacked(q.reshape(rows, k), _f16(b[..., 0:2]), None, 128, 32)


def _q2_k(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, QK_K, 84, "Q2_K")
    scales, d, dmin = b[..., 0:16], _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    scale = d * (scales & 0x0F).astype(np.float32)  # (r, n, 16)
    mins = -(dmin * (scales >> 4).astype(np.float32))
    q = _crumbs(b[..., 16:80])
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), mins.reshape(rows, -1), 0, 16)


def _q3_k(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, QK_K, 110, "Q3_K")
    scales, d = b[..., 96:108], _f16(b[..., 108:110])[..., None]
    low = (scales[..., 0:8, None] >> np.array([0, 4], dtype=np.uint8)).transpose(0, 1, 3, 2).reshape(rows, -1, 16)
    high = (scales[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 1, 3, 2)
    sc = (low & 0x0F) | ((high.reshape(rows, -1, 16) & 0x03) << 4)
    scale = d * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)  # (r, n, 16)
    q = _crumbs(b[..., 32:96]) + (_bit_planes(b[..., 0:32]) << 2)  # ggml: ql - 4 * (1 - h) = q - 4
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), None, 4, 16)


def _q4_q5_k(kind: str, data: np.ndarray, rows: int, k: int) -> Unpacked:
    """Q4_K, Q5_K: f16 d and dmin, 12 bytes of 6-bit scales and mins, [32 bytes of high bits,] nibbles."""
    five = kind == "Q5_K"
    b = _blocks(data, rows, k, QK_K, 176 if five else 144, kind)
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    s, m, m_s = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = np.concatenate([s & 0x3F, (m_s & 0x0F) | ((s >> 2) & 0x30)], axis=-1)  # the 8 sub-blocks' scales
    mn = np.concatenate([m & 0x3F, (m_s >> 4) | ((m >> 2) & 0x30)], axis=-1)  # and minimums
    qs = b[..., 48 if five else 16:].reshape(rows, -1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1, 256)  # 64 inputs per 32 bytes
    if five:
        q = q | (_bit_planes(b[..., 16:48]) << 4)
    scale, mins = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), mins.reshape(rows, -1), 0, 32)


def _q6_k(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, QK_K, 210, "Q6_K")
    ql, d = b[..., 0:128], _f16(b[..., 208:210])[..., None]
    low = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    q = low.reshape(rows, -1, 256) | (_crumbs(b[..., 128:192]) << 4)
    scale = d * b[..., 192:208].view(np.int8).astype(np.float32)  # (r, n, 16)
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), None, 32, 16)


SUPPORTED = {**{kind: partial(_q4_q5, kind) for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1")}, "Q8_0": _q8_0,
             "Q2_K": _q2_k, "Q3_K": _q3_k, **{kind: partial(_q4_q5_k, kind) for kind in ("Q4_K", "Q5_K")},
             "Q6_K": _q6_k}
