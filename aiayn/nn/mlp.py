"""Position-wise feed-forward network (paper section 3.3) and its gated descendants.

FFN(x) = W_2 act(W_1 x + b_1) + b_2, applied to every position independently. Gated variants
(Shazeer 2020) multiply the activation by a second projection: SwiGLU = (silu(x W) * x V) W_2
(LLaMA), GeGLU with gelu.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.nn.dropout import Dropout
from aiayn.nn.matvec import Linear

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,
}
GATED = ("swiglu", "geglu")


class FeedForward(nn.Module):
    """d -> d_ff -> d, with ReLU/GELU/SiLU or a gated SwiGLU/GeGLU unit.

    Gated units project to 2 x d_ff at once (``fc_in``): the first half is the gate (through the
    activation), the second the value.
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", bias: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.activation, self.gated = activation, activation in GATED
        self.act = ACTIVATIONS[activation]
        self.fc_in = Linear(d_model, 2 * d_ff if self.gated else d_ff, bias=bias)
        self.fc_out = Linear(d_ff, d_model, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(b, t, d) -> (b, t, d)"""
        h = self.fc_in(x)  # (b, t, d_ff) or (b, t, 2 d_ff)
        if self.gated:
            gate, value = h.chunk(2, dim=-1)
            h = self.act(gate) * value
        else:
            h = self.act(h)
        return self.fc_out(self.dropout(h))
