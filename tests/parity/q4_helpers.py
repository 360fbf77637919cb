"""Helpers of the block-quantisation tests (test_q4_kernel.py, test_gguf_q4.py, test_q4_scaling.py):
GGUF blocks of every supported type, and the kernel's error bound as an assertion, on one product
or on every block layer of a model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

# Without the gguf package the modules that import these helpers are skipped, not collection errors
# (a machine with no test extras, such as a lent GPU's: scripts/gpu-check.sh).
pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from aiayn.fast.q4 import BlockLinear, BlockWeight, error_bound
from aiayn.interop.gguf_blocks import unpack

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants can quantise these
# K-quants: byte offsets of each block's float16 scale fields (ggml-common.h layouts)
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes) blocks of ``kind``: quantised random floats for the legacy types; random bits
    with finite scales of about 1 / sqrt(cols) for the K-quants (no quantiser in the gguf package)."""
    rng = np.random.default_rng(seed)
    if kind in LEGACY:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) / math.sqrt(cols), Q[kind])
    block_elems, block_bytes = GGML_QUANT_SIZES[Q[kind]]
    blocks = rng.integers(0, 256, (rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in K_SCALES[kind]:
        scales = (rng.uniform(0.5, 1.5, len(blocks)) * 0.01 / math.sqrt(cols)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def block_weight(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[BlockWeight, np.ndarray]:
    raw = gguf_blocks(kind, rows, cols, seed)
    u = unpack(kind, raw, rows, cols)
    mins = None if u.mins is None else torch.from_numpy(u.mins)
    weight = BlockWeight.from_values(torch.from_numpy(u.values), torch.from_numpy(u.scale), mins,
                                     offset=u.offset, block=u.block, kind=kind)
    return weight, dequantize(raw, Q[kind]).reshape(rows, cols)


def assert_within_bound(got: torch.Tensor, x: torch.Tensor, weight: BlockWeight) -> None:
    """|got - x W^T| <= the quantisation bound + float32 rounding (1e-5 of sum |x| |w|)."""
    exact = (x.double() @ weight.dequantize_rows().double().T)
    rounding = 1e-5 * (x.double().abs() @ weight.dequantize_rows().double().abs().T)
    excess = (got.double() - exact).abs() - error_bound(x, weight).double() - rounding
    assert excess.max() <= 0, f"{weight.kind}: over the bound by {excess.max():.3g}"


def kernel_arithmetic(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """What the kernel computes, in float64 from its own roundings: x quantised per block of the
    weight's (dx = max |x| / 127 in float32, xq = round-half-even(x * (127 / max |x|)) clamped to
    +-127), then W x^ with x^ = dx xq. (m, k) -> (m, n) float64."""
    m, k, block = x.shape[0], weight.k, weight.block
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # float32, as the kernel
    xq = torch.round(xb * inv).clamp(-127, 127)
    x_hat = (xq.double() * (amax / 127.0).double()).reshape(m, k)
    return x_hat @ weight.dequantize_rows().double().T


def assert_kernel_arithmetic(got: torch.Tensor, x: torch.Tensor, weight: BlockWeight) -> None:
    """``got`` is ``kernel_arithmetic`` but for float32 rounding (1e-5 of sum |x^| |w|): far tighter
    than the error bound, so that a change of scheme (say, the min term on the exact x) is caught."""
    expected = kernel_arithmetic(x, weight)
    scale = x.double().abs() @ weight.dequantize_rows().double().abs().T
    excess = (got.double() - expected).abs() - 1e-5 * scale
    assert excess.max() <= 0, f"{weight.kind}: off the kernel's arithmetic by {excess.max():.3g}"


def block_layers(model: torch.nn.Module) -> list[BlockLinear]:
    return [m for m in model.modules() if isinstance(m, BlockLinear)]


def check_bounds_on(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Run ``model`` on ``tokens``, checking every BlockLinear call against the bound; returns the
    number of calls checked."""
    calls = []

    def hook(module: BlockLinear, args: tuple, output: torch.Tensor) -> None:
        x = args[0].reshape(-1, module.in_features).float()
        assert_within_bound(output.reshape(-1, module.out_features), x, module.weight_blocks)
        calls.append(module)

    handles = [m.register_forward_hook(hook) for m in block_layers(model)]
    try:
        with torch.no_grad():
            assert model(tokens).logits.isfinite().all()  # logits are computed lazily: ask for them
    finally:
        for h in handles:
            h.remove()
    return len(calls)
