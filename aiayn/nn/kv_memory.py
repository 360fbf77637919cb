"""The memory a KV cache takes: the estimate ``aiayn kv-cache`` prints and the planners budget with."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
                   src_len: int = 0) -> int:
    """Memory of a KV cache: 2 (k and v) x layers x kv_heads x head_dim x seq_len x batch x bytes
    (batch 32, 32 layers, 32 heads of 128, 2048 tokens, float32: 64 GiB).

    ``dtype="int8"``/``"int4"``: 1 or 1/2 byte per element plus a float16 scale per token, head and
    ``group_size`` channels, as ``KVCache(quantize=...).nbytes``. ``src_len`` > 0: an encoder-decoder's
    cross-attention keys and values too, 2 x layers x kv_heads x head_dim x src_len x batch (float32
    for a quantised cache)."""
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("seq_len", seq_len), ("batch_size", batch_size)):
        if value <= 0:
            raise ValueError(f"kv_cache_bytes: {name} must be positive, got {value}")
    if src_len < 0:
        raise ValueError(f"kv_cache_bytes: src_len must be >= 0, got {src_len}")
    vectors = 2 * n_layers * n_kv_heads * seq_len * batch_size  # (k or v) x token x head
    quantized = isinstance(dtype, str) and dtype in QUANTIZED
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


def cache_sizes(config: ModelConfig) -> dict[str, int]:
    """The sizes a model's KV cache is made of (``kv_cache_bytes``' arguments but the batch, and n_heads,
    d_model); seq_len and an encoder-decoder's src_len are max_seq_len."""
    n_layers = config.n_decoder_layers if config.arch != "encoder-only" else config.n_layers
    return {"n_layers": n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
            "d_model": config.d_model, "head_dim": config.head_dim, "seq_len": config.max_seq_len,
            "src_len": config.max_seq_len if config.arch == "encoder-decoder" else 0}


def describe_kv_cache(*, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int,
                      batch_size: int, dtype: str = "float32", group_size: int | None = None,
                      src_len: int = 0) -> list[str]:
    """``kv_cache_bytes`` as lines to print: the total, the products it comes from, and what float32 (for
    a quantised cache) or multi-head attention (for GQA/MQA) would need instead."""
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
