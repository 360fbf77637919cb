"""Linear layers on a handful of rows (a decode step) as a multiply + sum, for ``torch.compile``.

A batch-1 decode step multiplies one row by every weight matrix: y = x W^T is a matrix-vector
product whose cost is reading W. On this CPU (2 threads) the matmul libraries read W slowly at
that shape: float32 ``F.linear`` at ~15 GB/s eager and ~20 GB/s with Inductor's frozen oneDNN
weights. Written as an element-wise multiply and a sum over the input dimension, Inductor fuses it
into one vectorised C++ loop over the output rows, split across the threads, that never
materialises the product: it reads W at ~35-40 GB/s in float32 (bfloat16 ~30 vs ~25 GB/s).
Measured on SmolLM2-135M's projections in one compiled graph: ``python -m benchmarks.matvec``.

Eager, the same expression would build the (rows, o, i) product in memory: use it only inside a
compiled graph (``aiayn.generate.compiled_decode_step`` does, through ``MatvecLinears``).

Shape letters: o out_features, i in_features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

# Up to how many rows (batch x tokens) the multiply + sum beats the compiled matmul, per weight
# dtype (python -m benchmarks.matvec, 2 threads, SmolLM2's projections): float32 1.9-2.4x faster
# up to 4 rows, even at 8; bfloat16 1.2x at 1 row, even from 2. Other dtypes keep the matmul.
MATVEC_MAX_ROWS = {torch.float32: 4, torch.bfloat16: 2}


def matvec_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., i), weight (o, i), bias (o,) or None -> (..., o), summed in float32.

    Equal to ``F.linear`` up to float rounding. Compiled, Inductor forms the products in float32
    too (it computes bfloat16 element-wise work in float32), so bfloat16 weights lose nothing to
    rounding the products.
    """
    # Realise x as a buffer of its own (as_strided needs one; a no-op view eager): otherwise
    # Inductor inlines the element-wise ops that produced x (a GELU, a norm) into the loop over
    # the weights and recomputes them once per output row.
    x = torch.as_strided(x, x.size(), x.stride())
    y = (x.unsqueeze(-2) * weight).sum(-1, dtype=torch.float32)  # (..., 1, i) * (o, i) -> (..., o)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def use_matvec(x: Tensor, weight: Tensor) -> bool:
    """Whether ``matvec_linear`` is the faster way to compute F.linear(x, weight) compiled."""
    rows = x.numel() // max(x.shape[-1], 1)
    return weight.dtype == x.dtype and rows <= MATVEC_MAX_ROWS.get(weight.dtype, 0)


class MatvecLinears(TorchFunctionMode):
    """Inside this mode, ``F.linear`` (so every ``nn.Linear``) on few enough rows runs as
    ``matvec_linear``; every other call, and larger inputs, pass through unchanged.

    Meant for a ``torch.compile``d function: dynamo traces the mode, so the choice is made once,
    at trace time, from static shapes, and costs nothing per call.
    """

    def __torch_function__(self, func: Callable[..., object], types: tuple[type, ...], args: tuple = (),
                           kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if use_matvec(x, weight):
                return matvec_linear(x, weight, bias)
        return func(*args, **kwargs)
