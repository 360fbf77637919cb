"""Position-wise feed-forward network (paper section 3.3), FFN(x) = W_2 act(W_1 x + b_1) + b_2, and
its gated variants (Shazeer 2020): SwiGLU = (silu(x W) * x V) W_2 (LLaMA), GeGLU."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ACTIVATIONS, GATED_ACTIVATIONS

# The element-wise function of each activation (a gated unit's, on its gate; names: config.ACTIVATIONS).
_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation_function(name: str) -> Callable[[Tensor], Tensor]:
    """The element-wise function of activation ``name`` (of a gated unit: its gate's)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}")
    return _FUNCTIONS[GATED_ACTIVATIONS.get(name, name)]


class FeedForward(nn.Module):
    """d -> d_ff -> d; a gated unit projects to 2 x d_ff at once, the gate first, then the value."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", bias: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.act = activation_function(activation)
        self.activation, self.gated = activation, activation in GATED_ACTIVATIONS
        self.fc_in = nn.Linear(d_model, 2 * d_ff if self.gated else d_ff, bias=bias)
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(b, t, d) -> (b, t, d)"""
        h = self.fc_in(x)  # (b, t, d_ff) or (b, t, 2 d_ff)
        if self.gated:
            gate, value = h.chunk(2, dim=-1)
            h = self.act(gate) * value
        else:
            h = self.act(h)
        return self.fc_out(self.dropout(h))
