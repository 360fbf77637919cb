"""Lower-precision weights for faster CPU inference: bfloat16, int8 and 4-bit (``aiayn.fast.q4``)
Linear layers. ``Int8Linear``: int8 weights per output channel through ATen's weight-only kernel
(one activation scale cannot hold LLaMA's outlier channels). Shape letters: o out, i in features."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

QUANTIZE_CHOICES = ("none", "bf16", "int8", "q4", "auto")
_HAS_INT8_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 (o, i) and a float32 scale per output row (o,)."""

    def __init__(self, weight_int8: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_int8.shape[1], weight_int8.shape[0]
        self.register_buffer("weight_int8", weight_int8)  # (o, i) int8
        self.register_buffer("scale", scale)  # (o,) float32
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))  # the kernel's dtype
        # The CPU kernel reads the rows in blocks of 8 (other widths crash it, torch 2.13).
        self.use_kernel = _HAS_INT8_KERNEL and self.in_features % 8 == 0 and weight_int8.is_contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach().float()  # (o, i)
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (o,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale, linear.bias)

    def dequantized(self) -> Tensor:
        """The float32 weight (o, i) this layer stands for."""
        return self.weight_int8.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        """x (..., i) -> (..., o), in x's dtype."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.use_kernel:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.weight_int8,
                                                   self.scale_bf16)
        else:  # dequantise on the fly (correct, not fast)
            y = x2.float() @ self.dequantized().T
        y = y.float()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by an ``Int8Linear``, in place; returns the model."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear.from_linear(child))
        else:
            quantize_int8_(child)
    return model


def lower_precision(model: nn.Module, quantize: str) -> nn.Module:
    """``quantize``: "none" or "auto" (as is), "bf16" (all weights), "int8" or "q4" (Linear weights, the
    rest float32). Returns the model, modified in place."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    from aiayn.fast.compiled_decode import forget_compiled

    if quantize not in ("none", "auto"):
        forget_compiled(model)  # its layers or dtype change in place: a compiled graph of it is stale
    if quantize == "bf16":
        return model.to(torch.bfloat16)
    if quantize == "int8":
        return quantize_int8_(model.float())
    if quantize == "q4":
        from aiayn.fast.q4 import Q4_BLOCK, quantize_q4_

        kept = [name for name, m in model.named_modules()
                if isinstance(m, nn.Linear) and m.in_features % Q4_BLOCK != 0]
        if kept:  # said, not silent: the model is bigger and slower than "q4" promises
            warnings.warn(f"q4 keeps {len(kept)} linear layer(s) in float32 because their input width is not a "
                          f"multiple of {Q4_BLOCK} (the 4-bit block): {', '.join(kept[:3])}"
                          f"{', ...' if len(kept) > 3 else ''}", stacklevel=2)
        return quantize_q4_(model.float())
    return model
