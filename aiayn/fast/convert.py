"""The converter: ``optimize(model, mode)`` swaps a built model's plain modules for aiayn's CPU kernels
in place (as torchao's ``quantize_``), ``plain(model)`` swaps them back: ``nn.Linear`` ->
``FastLinear`` (a training output layer: ``FusedLossLinear``), ``nn.Dropout`` -> ``FastDropout``,
attention -> ``fast_attention`` and ``paged_cache_attention``, a LoRA layer's ``base_kernel`` ->
``fast_linear``. Parameters and state-dict keys are kept; a model off the CPU is left as it is."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from aiayn.fast.attention import fast_attention
from aiayn.fast.dropout import FastDropout
from aiayn.fast.fused_loss import FusedLossLinear
from aiayn.fast.linear import FastLinear, fast_linear
from aiayn.fast.paged_attention import paged_cache_attention
from aiayn.nn.attention import MultiHeadAttention, attend

MODES = ("train", "inference")
_PLAIN_CLASS = {FastLinear: nn.Linear, FusedLossLinear: nn.Linear, FastDropout: nn.Dropout}


def optimize(model: nn.Module, mode: str = "inference") -> nn.Module:
    """Swap ``model``'s plain modules for the CPU kernels in place (``mode="train"``: the fused loss too)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not known; choose one of {', '.join(MODES)}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        return model
    plain(model)  # (also forgets the model's compiled decode graphs: its layers change)
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FusedLossLinear if mode == "train" and module is head else FastLinear
        elif type(module) is nn.Dropout:
            module.__class__ = FastDropout
        elif isinstance(module, nn.Linear) and hasattr(module, "base_kernel"):
            module.base_kernel = fast_linear
        elif isinstance(module, MultiHeadAttention):
            module.kernel = fast_attention
            if not module.cross:
                module.cache_kernel = paged_cache_attention
    return model


def plain(model: nn.Module) -> nn.Module:
    """Undo ``optimize``: the plain modules and the plain attention function (in place)."""
    from aiayn.fast.compiled_decode import forget_compiled

    forget_compiled(model)
    for module in model.modules():
        if type(module) in _PLAIN_CLASS:
            module.__class__ = _PLAIN_CLASS[type(module)]
        elif isinstance(module, nn.Linear) and hasattr(module, "base_kernel"):
            module.base_kernel = F.linear
        elif isinstance(module, MultiHeadAttention):
            module.kernel = attend
            module.cache_kernel = None
    return model


def is_optimized(model: nn.Module) -> bool:
    """Whether ``optimize`` swapped any module of ``model``."""
    return any(type(m) in _PLAIN_CLASS or (isinstance(m, MultiHeadAttention) and m.kernel is fast_attention)
               or getattr(m, "base_kernel", None) is fast_linear for m in model.modules())
