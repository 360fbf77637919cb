"""The converter: ``optimize(model, mode)`` swaps a built model's plain modules for aiayn's CPU
kernels, in place, the way torchao's ``quantize_`` and torchtitan's converters work on a model
that was built plain. ``plain(model)`` swaps them back.

What it swaps (each one tested equal to the plain module it replaces, tests/consistency/
test_fast_modules.py and test_cpu_kernels.py; whole converted models: test_fast_convert.py; each
kernel's measurement sits beside it in its module):

=====================  =============================  ==========================================
plain module           fast module                    when it is faster
=====================  =============================  ==========================================
``nn.Linear``          ``FastLinear``                 oneDNN products (training, prefill); the
                                                      turned-around product on a few rows (decode)
output layer (train)   ``FusedLossLinear``            output layer + cross-entropy fused
``nn.Dropout``         ``FastDropout``                a cheaper CPU mask
attention kernel       ``fast_attention``             single-query decode, GQA decode,
                                                      block-causal training, CPU weight dropout
attention over a       ``paged_cache_attention``      decode over a paged KV cache: reads the
paged KV cache         (``cache_kernel``)             blocks in place instead of gathering them
=====================  =============================  ==========================================

The swap keeps every parameter, buffer and state-dict key (a class change, or a kernel function
set on ``MultiHeadAttention.kernel`` / ``cache_kernel``): checkpoints, tied weights and optimisers are unaffected.
Models on a device without these kernels (a GPU) are left as they are.
"""

from __future__ import annotations

from torch import nn

from aiayn.fast.attention import fast_attention
from aiayn.fast.dropout import FastDropout
from aiayn.fast.fused_loss import FusedLossLinear
from aiayn.fast.linear import FastLinear
from aiayn.fast.paged_attention import paged_cache_attention
from aiayn.nn.attention import MultiHeadAttention, attend

MODES = ("train", "inference")
_PLAIN_CLASS = {FastLinear: nn.Linear, FusedLossLinear: nn.Linear, FastDropout: nn.Dropout}


def optimize(model: nn.Module, mode: str = "inference") -> nn.Module:
    """Swap ``model``'s plain modules for the CPU kernels (in place; returns ``model``).

    ``mode="train"``: also fuse the output layer with the loss (``lm_head``: the training loss
    finds it there). ``"inference"``: the same kernels, each choosing its decode paths itself.
    A model whose parameters are not on the CPU is returned unchanged (there are no kernels for it).
    """
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
        elif isinstance(module, MultiHeadAttention):
            module.kernel = attend
            module.cache_kernel = None
    return model


def is_optimized(model: nn.Module) -> bool:
    """Whether ``optimize`` swapped any module of ``model``."""
    return any(type(m) in _PLAIN_CLASS or (isinstance(m, MultiHeadAttention) and m.kernel is fast_attention)
               for m in model.modules())
