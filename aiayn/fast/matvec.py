"""Linear layers on a handful of rows (a decode step), the ways that run fastest compiled.

A batch-1 decode step multiplies one row by every weight matrix: y = x W^T is a matrix-vector
product whose cost is reading W. At that shape the CPU matmul libraries read W slowly, eager or
with Inductor's frozen oneDNN weights. Written as an element-wise multiply and a sum over the
input dimension, Inductor fuses it into one vectorised C++ loop over the output rows, split across
the threads, that never materialises the product and reads W faster, in float32 and bfloat16
(``python -m benchmarks.matvec`` measures both ways; docs/benchmarks.md has the figures).

From 3 to 64 float32 rows the matmul itself is faster turned around, (W x^T)^T: the few rows
become the narrow right-hand side (``transposed_linear``).

Eager, the multiply + sum would build the (rows, o, i) product in memory: use it only inside a
compiled graph (``aiayn.fast.compiled_decode`` does, through ``MatvecLinears``). The
(W x^T)^T turn pays off eager too, from 2 to 64 float32 rows (a batched decode or beam-search
step): ``aiayn.fast.linear.FastLinear`` takes it when no autograd graph is being built.

Shape letters: o out_features, i in_features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

# Which way each linear layer of a compiled decode step runs, by rows (batch x tokens) and weight
# dtype: the fastest against the compiled F.linear in ``python -m benchmarks.matvec`` (SmolLM2's
# projections; the figures are in docs/benchmarks.md). Multiply + sum wins at 1-2 rows (float32 and
# bfloat16), (W x^T)^T for float32 up to 64 rows; bfloat16 past 2 rows keeps F.linear, as do the
# cases not benchmarked (other dtypes, GPU tensors).
MATVEC_MAX_ROWS = {torch.float32: 2, torch.bfloat16: 2}
TRANSPOSED_MAX_ROWS = {torch.float32: 64}
# Eager (``FastLinear``), same benchmark, "eager (W x^T)^T" against "eager F.linear": float32 from 2
# to 64 rows (at 1 row F.linear's matrix-vector kernel is as fast).
EAGER_TRANSPOSED_ROWS = {torch.float32: (2, 64)}
# The turned-around product gains by splitting the output rows across threads: on one thread it
# does not beat F.linear (``python -m benchmarks.fast --threads 1,2``), so one thread keeps F.linear.
MIN_THREADS_TRANSPOSED = 2


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


def transposed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., i), weight (o, i), bias (o,) or None -> (..., o) as (W x^T)^T: the same matmul with
    the few rows of x as the narrow right-hand side, the orientation the matmul library runs faster."""
    y = (weight @ x.reshape(_rows(x), x.shape[-1]).t()).t()  # (o, i) @ (i, rows) -> (rows, o)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _threads() -> int:
    """torch's intra-op thread count; read once at trace time inside a compiled function (a decode
    step compiled at one thread count keeps its choice if the count changes afterwards), once
    ``mark_for_compile`` has told Dynamo so."""
    return torch.get_num_threads()


_marked = False


def mark_for_compile() -> None:
    """Let Dynamo trace ``_threads`` as a constant (it cannot trace ``torch.get_num_threads``).
    Called by the code that compiles, not at import: ``torch.compiler.assume_constant_result``
    imports torch._dynamo, ~70 MiB of resident memory an eager process need not pay."""
    global _threads, _marked
    if not _marked:  # once: wrapping it again would only stack wrappers
        _threads = torch.compiler.assume_constant_result(_threads)
        _marked = True


def _rows(x: Tensor) -> int:
    """Rows of x (..., i): the product of its leading dimensions."""
    return x.numel() // max(x.shape[-1], 1)


def _measured(x: Tensor, weight: Tensor) -> bool:
    """The thresholds were measured on the CPU, for matching dtypes: elsewhere keep F.linear."""
    return x.device.type == "cpu" and weight.device.type == "cpu" and weight.dtype == x.dtype


def use_matvec(x: Tensor, weight: Tensor) -> bool:
    """Whether ``matvec_linear`` is the faster way to compute F.linear(x, weight) compiled."""
    return _measured(x, weight) and _rows(x) <= MATVEC_MAX_ROWS.get(weight.dtype, 0)


def use_transposed(x: Tensor, weight: Tensor) -> bool:
    """Whether ``transposed_linear`` is the faster way to compute F.linear(x, weight) compiled."""
    return (_measured(x, weight) and _rows(x) <= TRANSPOSED_MAX_ROWS.get(weight.dtype, 0)
            and _threads() >= MIN_THREADS_TRANSPOSED)


def use_eager_transposed(x: Tensor, weight: Tensor) -> bool:
    """Whether ``transposed_linear`` is the faster way to compute F.linear(x, weight) eager."""
    low, high = EAGER_TRANSPOSED_ROWS.get(weight.dtype, (1, 0))
    return (low <= _rows(x) <= high and _measured(x, weight)
            and _threads() >= MIN_THREADS_TRANSPOSED)


class MatvecLinears(TorchFunctionMode):
    """Inside this mode, ``F.linear`` (so every ``nn.Linear``) on few enough rows runs as
    ``matvec_linear`` or ``transposed_linear``, whichever was measured faster for its rows and
    dtype; every other call, and larger inputs, pass through unchanged.

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
            if use_transposed(x, weight):
                return transposed_linear(x, weight, bias)
        return func(*args, **kwargs)
