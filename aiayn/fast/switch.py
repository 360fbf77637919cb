"""One switch for every aiayn CPU kernel an optimized model holds (``aiayn.fast.optimize``: its
linear layers, attention kernel and dropout), so they can be compared with plain torch ops
without converting the model back (``aiayn.fast.plain`` does that).

They compute the same functions as ``F.linear``, ``F.scaled_dot_product_attention`` and
``F.dropout`` (tests/consistency/test_fast_modules.py, test_cpu_kernels.py), only faster on a
CPU. Turn them off for a whole process with ``AIAYN_PLAIN_TORCH=1`` in the environment, or for a block of code with ``plain_torch()``.

One kernel alone can be turned off for a block of code, the others staying on, with
``without("prefill_attention")`` (its name in ``KERNELS``): what a benchmark's A/B of that kernel
needs. A kernel that has a name asks ``kernel_enabled(name)`` instead of ``enabled()``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# AIAYN_PLAIN_TORCH=1 (or true/yes/on) turns the kernels off; unset, empty, 0, false, no, off leave them on.
_enabled = os.environ.get("AIAYN_PLAIN_TORCH", "").strip().lower() in ("", "0", "false", "no", "off")


# The kernels that can be turned off one at a time (``without``): each one's module name in aiayn.fast.
KERNELS = ("paged_attention", "prefill_attention")
_off: set[str] = set()


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


def kernel_enabled(name: str) -> bool:
    """Whether the kernel ``name`` (one of ``KERNELS``) may be used: the kernels are on
    (``enabled``) and this one is not turned off alone (``without``)."""
    return enabled() and name not in _off


@contextmanager
def without(*names: str) -> Iterator[None]:
    """Within this block, the named kernels (of ``KERNELS``) are off, every other one as it was.
    For every thread of the process (an engine's thread too): a benchmark's switch, not a per-call
    option."""
    unknown = [name for name in names if name not in KERNELS]
    if unknown:
        raise ValueError(f"no kernel named {', '.join(unknown)}; the ones that turn off alone: {', '.join(KERNELS)}")
    added = set(names) - _off
    _off.update(added)
    try:
        yield
    finally:
        _off.difference_update(added)
