"""aiayn's speed, applied to a built model: CPU kernels beside the plain PyTorch of ``aiayn.nn``.

``optimize(model, mode)`` swaps modules in place (``aiayn.fast.convert``), ``plain(model)`` swaps
them back, ``plain_torch()`` turns every kernel off for a block of code. Nothing in ``aiayn.nn`` or
``aiayn.models`` imports this package."""

from aiayn.fast.convert import MODES, is_optimized, optimize, plain
from aiayn.fast.switch import enabled, plain_torch

__all__ = ["MODES", "enabled", "is_optimized", "optimize", "plain", "plain_torch"]
