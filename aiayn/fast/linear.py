"""Linear layers through the fastest CPU product for their shape (``FastLinear``).

Two cases beat ``F.linear`` (MKL sgemm) on the CPU: a few rows (a batched decode step) as the
turned-around product (W x^T)^T (``aiayn.fast.matvec``, ``python -m benchmarks.matvec``), and large
float32 products through oneDNN (``aiayn.fast.onednn``, ``python -m benchmarks.onednn``). Every
other call is ``nn.Linear``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.fast import switch
from aiayn.fast.matvec import transposed_linear, use_eager_transposed
from aiayn.fast.onednn import onednn_linear, use_onednn


class FastLinear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict; ``aiayn.fast.optimize`` swaps it in for a
    built model's ``nn.Linear`` layers) with two faster ways on the CPU:

    * a decode step, x (b, 1, i) or the last positions' rows (b, i) too few for oneDNN, with b from
      2 to 64 float32 rows and two threads or more, runs as (W x^T)^T (``transposed_linear``) when no autograd
      graph is being built (generation runs under ``torch.inference_mode``);
    * float32 inputs of at least 64 rows and 16.8M multiply-adds (training, prefill) run through
      oneDNN (``aiayn.fast.onednn``: faster than MKL's matmul on AMD processors, float32 sums in
      another order; the parity tests against Hugging Face still hold at default tolerances).

    Every other call is ``nn.Linear``'s. Plain tensors only: sharded (DTensor) weights keep
    ``nn.Linear``'s forward.
    """

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        # Cheapest tests first: this runs for every projection of every forward.
        step = x.dim() == 3 and x.shape[1] == 1  # (b, 1, i); or (b, i): a head on the last positions
        if ((step or (x.dim() == 2 and not use_onednn(x, weight))) and not torch.is_grad_enabled()
                and use_eager_transposed(x, weight) and type(x) is Tensor
                and type(weight) in (Tensor, nn.Parameter) and switch.enabled()):
            return transposed_linear(x, weight, self.bias)
        if use_onednn(x, weight):  # float32 CPU, >= 64 rows: see aiayn.fast.onednn
            return onednn_linear(x, weight, self.bias)
        return F.linear(x, weight, self.bias)
