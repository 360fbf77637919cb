"""aiayn's speed, applied to a built model: CPU kernels beside the plain PyTorch of ``aiayn.nn``.

``optimize(model, mode)`` swaps modules in place (``aiayn.fast.convert``); ``plain(model)`` swaps
them back; ``plain_torch()`` turns every kernel off for a block of code (``AIAYN_PLAIN_TORCH=1``
for a whole process). Each kernel lives in its own module with the measurement that justifies it:
``linear`` (oneDNN / turned-around products), ``attention`` (decode and block-causal paths),
``dropout``, ``fused_loss`` (output layer + cross-entropy), ``quantize`` (bfloat16 and int8
weights), ``compiled_decode`` (the ``torch.compile``d decode step with ``matvec``'s products).
Nothing in ``aiayn.nn`` or ``aiayn.models`` imports this package.
"""

from aiayn.fast.convert import MODES, is_optimized, optimize, plain
from aiayn.fast.switch import enabled, plain_torch

__all__ = ["MODES", "enabled", "is_optimized", "optimize", "plain", "plain_torch"]
