"""Linear layers on a handful of rows (a decode step), the ways that run fastest compiled. At batch 1
y = x W^T costs reading W: as a multiply and a sum Inductor fuses it into one vectorised loop
(``matvec_linear``, compiled only). From 3 to 64 float32 rows (W x^T)^T is faster (``transposed_linear``).

Shape letters: o out_features, i in_features."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

# The most rows each way is fastest for, by weight dtype (``python -m benchmarks.matvec``); else F.linear.
MATVEC_MAX_ROWS = {torch.float32: 2, torch.bfloat16: 2}
TRANSPOSED_MAX_ROWS = {torch.float32: 64}
# Eager (``FastLinear``), from the same benchmark.
EAGER_TRANSPOSED_ROWS = {torch.float32: (2, 64)}
# The turned-around product gains by splitting the output rows across threads: not on one thread.
MIN_THREADS_TRANSPOSED = 2


def matvec_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., i), weight (o, i), bias (o,) or None -> (..., o), summed in float32."""
    # Realise x as a buffer of its own: otherwise Inductor recomputes what produced x per output row.
    x = torch.as_strided(x, x.size(), x.stride())
    y = (x.unsqueeze(-2) * weight).sum(-1, dtype=torch.float32)  # (..., 1, i) * (o, i) -> (..., o)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def transposed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., i), weight (o, i), bias (o,) or None -> (..., o) as (W x^T)^T."""
    y = (weight @ x.reshape(_rows(x), x.shape[-1]).t()).t()  # (o, i) @ (i, rows) -> (rows, o)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _threads() -> int:
    """torch's intra-op thread count, a constant at trace time once ``mark_for_compile`` has run."""
    return torch.get_num_threads()


@cache  # once: wrapping it again would only stack wrappers
def mark_for_compile() -> None:
    """Let Dynamo trace ``_threads`` as a constant (this imports torch._dynamo: call it when compiling)."""
    global _threads
    _threads = torch.compiler.assume_constant_result(_threads)


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
    """Inside this mode ``F.linear`` on few enough rows runs as ``matvec_linear`` or ``transposed_linear``,
    whichever was measured faster (for a compiled function: chosen at trace time)."""

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
