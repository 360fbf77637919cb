"""One switch for every aiayn CPU kernel, to compare with plain torch ops without converting the model
back: ``AIAYN_PLAIN_TORCH=1`` for a process, ``plain_torch()`` for a block, ``without(name)`` for one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# AIAYN_PLAIN_TORCH=1 (or true/yes/on) turns the kernels off; unset, empty, 0, false, no, off leave them on.
_enabled = os.environ.get("AIAYN_PLAIN_TORCH", "").strip().lower() in ("", "0", "false", "no", "off")

# The kernels that turn off one at a time (``without``): their module names in aiayn.fast.
KERNELS = ("paged_attention", "prefill_attention")
_off: set[str] = set()


def enabled() -> bool:
    """Whether aiayn's CPU kernels may be used: not when turned off, nor under a ``torch.func`` transform."""
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
    """Whether the kernel ``name`` (of ``KERNELS``) may be used: ``enabled`` and not turned off alone."""
    return enabled() and name not in _off


@contextmanager
def without(*names: str) -> Iterator[None]:
    """Within this block the named kernels are off, for every thread of the process."""
    unknown = [name for name in names if name not in KERNELS]
    if unknown:
        raise ValueError(f"no kernel named {', '.join(unknown)}; the ones that turn off alone: {', '.join(KERNELS)}")
    added = set(names) - _off
    _off.update(added)
    try:
        yield
    finally:
        _off.difference_update(added)
