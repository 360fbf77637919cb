"""Linear layers through the fastest CPU product for their shape (``FastLinear``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.fast import switch
from aiayn.fast.matvec import transposed_linear, use_eager_transposed
from aiayn.fast.onednn import onednn_linear, use_onednn


class FastLinear(nn.Linear):
    """``nn.Linear`` with two faster ways on the CPU: a few float32 rows (2 to 64, two threads or more, no
    autograd) as (W x^T)^T (``transposed_linear``), and large float32 products through oneDNN."""

    def forward(self, x: Tensor) -> Tensor:
        return fast_linear(x, self.weight, self.bias)


def fast_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through the fastest CPU product for its shape (see ``FastLinear``)."""
    # Cheapest tests first: this runs for every projection of every forward.
    step = x.dim() == 3 and x.shape[1] == 1  # (b, 1, i); or (b, i): a head on the last positions
    if ((step or (x.dim() == 2 and not use_onednn(x, weight))) and not torch.is_grad_enabled()
            and use_eager_transposed(x, weight) and type(x) is Tensor
            and type(weight) in (Tensor, nn.Parameter) and switch.enabled()):
        return transposed_linear(x, weight, bias)
    if use_onednn(x, weight):  # float32 CPU, >= 64 rows: see aiayn.fast.onednn
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)
