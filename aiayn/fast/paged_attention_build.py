"""Builds and loads ``paged_attention.cpp`` (attention read through a paged cache's block table) on
first use, the way ``aiayn.fast.q4_build`` builds the 4-bit kernel: ``load_inline`` with the system
C++ compiler for this CPU (``-march=native``) into torch's extension cache, named by a hash of the
source, flags, torch version and CPU (a later process loads it in milliseconds; the first build takes
~20-40 s), under q4_build's OS lock (a build that was killed never blocks the next one).
The op lands in ``torch.ops.aiayn_paged`` (``attention``, ``parallel``), with a shape function
registered so that ``torch.compile`` can trace it.

Without a compiler (or ``ninja``), ``kernel_ops()`` warns once and returns None: a paged cache is
then read by the plain gather + SDPA (correct, slower at large batches). ``AIAYN_PAGED_KERNEL=0``
skips the build.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from aiayn.fast.q4_build import OPENMP, _one_builder, cpu_identity

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = ["-O3", "-march=native", "-std=c++17"]


@lru_cache(maxsize=1)
def kernel_ops() -> Any | None:
    """``torch.ops.aiayn_paged`` once built and loaded; None where it cannot be built (or is turned
    off by ``AIAYN_PAGED_KERNEL=0``)."""
    if os.environ.get("AIAYN_PAGED_KERNEL", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if hasattr(torch.ops.aiayn_paged, "attention"):  # loaded by an earlier call in this process
        return torch.ops.aiayn_paged
    return _build()


def build_name(flags: list[str]) -> str:
    """The extension's name in torch's cache: a hash of the source, the flags, torch's version and the
    CPU (``-march=native`` code built on one CPU may not run on another sharing the cache)."""
    source = SOURCE.read_text(encoding="utf-8")
    key = source + " ".join(flags) + torch.__version__ + cpu_identity()
    return "aiayn_paged_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _build() -> Any | None:
    source = SOURCE.read_text(encoding="utf-8")
    error: Exception | None = None
    for extra in ([OPENMP], []):  # with OpenMP (threads), else serial
        flags = FLAGS + extra
        name = build_name(flags)
        try:
            from torch.utils.cpp_extension import load_inline

            with _one_builder(name):
                load_inline(name, cpp_sources=[source], no_implicit_headers=True, is_python_module=False,
                            extra_cflags=flags, extra_ldflags=extra, verbose=False)
        except Exception as exc:  # no compiler, no ninja, no OpenMP, a build error
            error = exc
            continue
        if not extra:
            warnings.warn("aiayn's paged-attention kernel was built without OpenMP (the compiler refused "
                          "-fopenmp): it runs on one thread", stacklevel=2)
        _register_fake()
        return torch.ops.aiayn_paged
    text = str(error).strip()
    first = text.splitlines()[-1] if text else type(error).__name__
    warnings.warn(f"aiayn's paged-attention kernel could not be built ({first[:200]}); a paged KV cache "
                  f"is read by gathering its blocks instead (slower at large batches)", stacklevel=2)
    return None


def _register_fake() -> None:
    """The output's shape and layout for torch.compile's tracing: (b, h, t_q, d_h), laid out
    (b, t_q, h, d_h) as the kernel writes it."""

    @torch.library.register_fake("aiayn_paged::attention")
    def _attention(q, k, v, table, t_k, mask, scale):  # type: ignore[no-untyped-def]
        b, h, t_q, d_h = q.shape
        return q.new_empty(b, t_q, h, d_h).transpose(1, 2)
