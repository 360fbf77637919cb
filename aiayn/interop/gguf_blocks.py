"""GGUF's quantised blocks, unpacked (not dequantised) into aiayn's block format (``aiayn.fast.q4``):
``w = scale * (q - offset) + min`` per block of 16 or 32 inputs, q unsigned. Every type maps onto it exactly
(float32 scales as ggml computes them), so ``BlockWeight.dequantize_rows()`` equals ``gguf.quants.dequantize``
bit for bit. ggml's formulas: Q4_0 d(q - 8), Q5_0 d(q - 16), Q4_1 and Q5_1 dq + m, Q8_0 dq (q signed, stored
q + 128), Q2_K, Q4_K and Q5_K d·sc·q - dmin·m, Q3_K d(sc - 32)(q - 4), Q6_K d·sc(q - 32).
Bit layouts follow ``gguf.quants``. Shape letters: r rows, n blocks per row, k inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256


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


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and minimums -> two (..., 8) arrays."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


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


def _q4_0(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, 32, 18, "Q4_0")
    return Unpacked(_nibbles_16(b[..., 2:]).reshape(rows, k), _f16(b[..., 0:2]), None, 8, 32)


def _q4_1(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, 32, 20, "Q4_1")
    return Unpacked(_nibbles_16(b[..., 4:]).reshape(rows, k), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 0, 32)


def _q5_0(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, 32, 22, "Q5_0")
    q = _nibbles_16(b[..., 6:]) | (_bits_32(b[..., 2:6]) << 4)
    return Unpacked(q.reshape(rows, k), _f16(b[..., 0:2]), None, 16, 32)


def _q5_1(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, 32, 24, "Q5_1")
    q = _nibbles_16(b[..., 8:]) | (_bits_32(b[..., 4:8]) << 4)
    return Unpacked(q.reshape(rows, k), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 0, 32)


def _q8_0(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, 32, 34, "Q8_0")
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Unpacked(q.reshape(rows, k), _f16(b[..., 0:2]), None, 128, 32)


def _q2_k(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, QK_K, 84, "Q2_K")
    scales, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    scale = d * (scales & 0x0F).astype(np.float32)  # (r, n, 16)
    mins = -(dmin * (scales >> 4).astype(np.float32))
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = (qs.reshape(rows, -1, 2, 1, 32) >> shifts) & 3  # (r, n, 2, 4, 32) -> 256 inputs in order
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), mins.reshape(rows, -1), 0, 16)


def _q3_k(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, QK_K, 110, "Q3_K")
    hmask, qs, scales, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])[..., None]
    low = (scales[..., 0:8, None] >> np.array([0, 4], dtype=np.uint8)).transpose(0, 1, 3, 2).reshape(rows, -1, 16)
    high = (scales[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 1, 3, 2)
    sc = (low & 0x0F) | ((high.reshape(rows, -1, 16) & 0x03) << 4)
    scale = d * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)  # (r, n, 16)
    shifts2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    ql = (qs.reshape(rows, -1, 2, 1, 32) >> shifts2) & 3  # (r, n, 2, 4, 32)
    hbit = (hmask.reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = ql.reshape(rows, -1, 256) + (hbit.reshape(rows, -1, 256) << 2)  # ggml: ql - 4 * (1 - h) = q - 4
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), None, 4, 16)


def _q4_k(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, QK_K, 144, "Q4_K")
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:144].reshape(rows, -1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3)  # (r, n, 4, 2, 32): 64 inputs per 32 bytes
    scale = d * sc.astype(np.float32)
    mins = -(dmin * mn.astype(np.float32))
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), mins.reshape(rows, -1), 0, 32)


def _q5_k(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, QK_K, 176, "Q5_K")
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scale_min(b[..., 4:16])
    qh, qs = b[..., 16:48], b[..., 48:176].reshape(rows, -1, 4, 1, 32)
    ql = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1, 8, 32)
    high = (qh.reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = ql | (high << 4)
    scale = d * sc.astype(np.float32)
    mins = -(dmin * mn.astype(np.float32))
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), mins.reshape(rows, -1), 0, 32)


def _q6_k(data: np.ndarray, rows: int, k: int) -> Unpacked:
    b = _blocks(data, rows, k, QK_K, 210, "Q6_K")
    ql, qh, scales, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])[..., None]
    low = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = low.reshape(rows, -1, 8, 32) | (high.reshape(rows, -1, 8, 32) << 4)
    scale = d * scales.view(np.int8).astype(np.float32)  # (r, n, 16)
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), None, 32, 16)


SUPPORTED = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
