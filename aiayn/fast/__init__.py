"""aiayn's CPU kernels beside the plain PyTorch of ``aiayn.nn``: ``optimize(model, mode)`` swaps them in
(``aiayn.fast.convert``), ``plain(model)`` back, ``plain_torch()`` turns them off for a block of code.
Nothing in ``aiayn.nn`` or ``aiayn.models`` imports this package."""

from aiayn.fast.convert import MODES, is_optimized, optimize, plain
from aiayn.fast.switch import enabled, plain_torch

__all__ = ["MODES", "enabled", "is_optimized", "optimize", "plain", "plain_torch"]
