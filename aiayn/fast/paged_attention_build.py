"""Builds and loads ``paged_attention.cpp`` on first use into ``torch.ops.aiayn_paged`` (as ``q4_build``);
without a compiler, or with ``AIAYN_PAGED_KERNEL=0``, ``kernel_ops()`` is None: the plain gather + SDPA."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from aiayn.fast.q4_build import build_kernel

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = ["-O3", "-march=native", "-std=c++17"]


@lru_cache(maxsize=1)
def kernel_ops() -> Any | None:
    """``torch.ops.aiayn_paged`` once built and loaded; None where it cannot be built or is turned off."""
    if os.environ.get("AIAYN_PAGED_KERNEL", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if hasattr(torch.ops.aiayn_paged, "attention"):  # loaded by an earlier call in this process
        return torch.ops.aiayn_paged
    return build_kernel(SOURCE, "aiayn_paged_", FLAGS, "paged-attention kernel", _register_fake,
                        lambda: torch.ops.aiayn_paged,
                        fallback="a paged KV cache is read by gathering its blocks instead (slower at large batches)")


def _register_fake() -> None:
    """The output's shape for tracing: (b, h, t_q, d_h), laid out (b, t_q, h, d_h) as the kernel writes."""

    @torch.library.register_fake("aiayn_paged::attention")
    def _attention(q, k, v, table, t_k, mask, scale):  # type: ignore[no-untyped-def]
        b, h, t_q, d_h = q.shape
        return q.new_empty(b, t_q, h, d_h).transpose(1, 2)
