"""Dropout (Srivastava et al. 2014; paper section 5.4) with a faster mask on the CPU: 16-bit slices of
torch's 64-bit random integers (seeds and exact resume hold) instead of a Bernoulli draw per element;
an element is dropped when its value is below ``round(p * 65536)``. Other devices use ``F.dropout``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.fast import switch

_LEVELS = 1 << 16  # a 16-bit slice of a random int64 is uniform over 65,536 values


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, *, device: torch.device | None = None) -> Tensor:
    """Bool tensor of ``shape``: True with probability 1 - p (p rounded to a multiple of 1/65536)."""
    n = math.prod(shape)
    draws = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=device)
    values = draws.view(torch.int16)[:n].view(shape)  # uniform over [-32768, 32767]
    return values >= round(p * _LEVELS) - _LEVELS // 2


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element of ``x`` with probability ``p`` and scale the rest by 1 / (1 - p)."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if p == 1.0:
        return x * 0.0
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    scale = keep_mask(x.shape, p, device=x.device).to(x.dtype).mul_(1.0 / (1.0 - p))  # no grad
    return x * scale  # backward: grad * scale, the same mask


class FastDropout(nn.Dropout):
    """``nn.Dropout`` (same arguments, no parameters) that uses :func:`dropout`."""

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace or not switch.enabled():
            return super().forward(x)
        return dropout(x, self.p, self.training)
