"""float32 linear layers through oneDNN on the CPU, faster than ``F.linear`` (MKL, which picks kernels
by CPU vendor) on AMD: ``onednn_linear`` gives ``torch.ops.mkldnn._linear_pointwise`` an autograd
formula as a custom op. Shape letters: m rows, i in_features, o out_features."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import flop_registry, register_flop_formula

from aiayn.fast import switch

# Fewer rows: no faster than F.linear.
MIN_ROWS = 64
# Less work (rows x in x out multiply-adds) than this: the op's fixed cost outweighs the gain.
MIN_WORK = 1 << 24


def _find_op() -> Any:
    try:
        if torch.backends.mkldnn.is_available():
            return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # a torch build without oneDNN or without the op
        pass
    return None


_LINEAR = _find_op()


def available() -> bool:
    """Whether this torch build has the oneDNN linear op."""
    return _LINEAR is not None


if _LINEAR is not None and _LINEAR not in flop_registry:  # a later torch may count it itself
    @register_flop_formula(_LINEAR)
    def _linear_flops(x_shape: torch.Size, w_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
        """So ``torch.utils.flop_counter`` counts these products like ``F.linear``'s."""
        return 2 * math.prod(x_shape[:-1]) * w_shape[0] * w_shape[1]


def linear_product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (m, i) @ weight (o, i)^T + bias -> (m, o), no autograd; either operand may be transposed."""
    return _LINEAR(x, weight, bias, "none", [], "")


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a (m, k) @ b (k, n) -> (m, n) through oneDNN (callers check ``use_onednn`` first)."""
    return linear_product(a, b.t())


def weight_gradient(grad: Tensor, x: Tensor) -> Tensor:
    """grad (m, o)^T @ x (m, i) -> (o, i), contiguous, with the smaller weight dimension as the rows."""
    if x.shape[1] < grad.shape[1]:
        return linear_product(x.t(), grad.t()).t().contiguous()  # (i, o) -> (o, i)
    return linear_product(grad.t(), x.t())


# A custom op with its own autograd formula, which Inductor calls as an opaque kernel.
@torch.library.custom_op("aiayn::onednn_linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return linear_product(x, weight, bias)  # (m, o)


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("aiayn::onednn_linear_backward", mutates_args=())
def _linear_backward_op(grad: Tensor, x: Tensor, weight: Tensor, need_x: bool,
                        need_weight: bool) -> tuple[Tensor, Tensor]:
    grad = grad.contiguous()  # (m, o); a broadcast gradient (zero strides) becomes real memory
    grad_x = linear_product(grad, weight.t()) if need_x else x.new_empty(0)  # (m, i) = g W
    grad_w = weight_gradient(grad, x) if need_weight else weight.new_empty(0)  # (o, i)
    return grad_x, grad_w


@_linear_backward_op.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_weight: bool) -> tuple[Tensor, Tensor]:
    return (grad.new_empty(grad.shape[0], weight.shape[1]) if need_x else x.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0))


def _setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor | None], output: Tensor) -> None:
    x, weight, bias = inputs
    # x only for the weight's gradient: a frozen weight keeps no activation alive.
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
    ctx.has_bias = bias is not None


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    x, weight = ctx.saved_tensors
    need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    x = x if x is not None else weight.new_empty(0, weight.shape[1])  # (unused: no weight gradient)
    grad_x, grad_w = _linear_backward_op(grad, x, weight, need_x, need_weight)
    grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x if need_x else None, grad_w if need_weight else None, grad_b


_linear_op.register_autograd(_backward, setup_context=_setup_context)


# FlopCounterMode sees the custom ops, not the products inside them: count them like nn.Linear's.
@register_flop_formula(torch.ops.aiayn.onednn_linear)
def _layer_flops(x_shape: torch.Size, w_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
    return 2 * x_shape[0] * w_shape[0] * w_shape[1]


@register_flop_formula(torch.ops.aiayn.onednn_linear_backward)
def _layer_backward_flops(grad_shape: torch.Size, x_shape: torch.Size, w_shape: torch.Size, need_x: bool,
                          need_weight: bool, *args: Any, **kwargs: Any) -> int:
    return (int(need_x) + int(need_weight)) * 2 * grad_shape[0] * w_shape[0] * w_shape[1]


def use_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether ``onednn_linear`` should compute F.linear(x, weight): large enough float32 CPU products."""
    return (
        _LINEAR is not None
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.numel() >= MIN_ROWS * x.shape[-1] > 0
        and x.numel() * weight.shape[0] >= MIN_WORK
        and type(x) is Tensor
        and type(weight) in (Tensor, nn.Parameter)
        and switch.enabled()
        and not torch.is_autocast_enabled("cpu")
    )


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN, differentiable in all three; check ``use_onednn`` first."""
    x2 = x.reshape(-1, x.shape[-1])  # (m, i), a view for contiguous x
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        y = _linear_op(x2, weight, bias)
    else:
        y = linear_product(x2, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
