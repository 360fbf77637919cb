"""One switch for every aiayn CPU kernel an optimized model holds (``aiayn.fast.optimize``: its
linear layers, attention kernel and dropout), so they can be compared with plain torch ops
without converting the model back (``aiayn.fast.plain`` does that).

They compute the same functions as ``F.linear``, ``F.scaled_dot_product_attention`` and
``F.dropout`` (tests/consistency/test_fast_modules.py, test_cpu_kernels.py), only faster on a
CPU. Turn them off for a whole process with ``AIAYN_PLAIN_TORCH=1`` in the environment, or for a block of code with ``plain_torch()``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# AIAYN_PLAIN_TORCH=1 (or true/yes/on) turns the kernels off; unset, empty, 0, false, no, off leave them on.
_enabled = os.environ.get("AIAYN_PLAIN_TORCH", "").strip().lower() in ("", "0", "false", "no", "off")


def enabled() -> bool:
    """Whether aiayn's CPU kernels may be used (each also checks its own conditions): not when
    turned off, nor under a ``torch.func`` transform (vmap, grad, jacrev, ...), which the kernels'
    autograd functions and custom ops do not support: plain torch ops do."""
    if torch.compiler.is_compiling():  # traced once; no functorch transform around a compiled graph
        return _enabled
    return _enabled and not torch._C._are_functorch_transforms_active()


@contextmanager
def plain_torch() -> Iterator[None]:
    """Within this block, every layer uses plain torch ops (``F.linear``, SDPA)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
