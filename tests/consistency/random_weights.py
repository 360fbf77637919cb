"""Seeded weights and padded batches for the consistency tests (imported by this folder's modules)."""

from __future__ import annotations

import math

import torch
from torch import nn


def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Seeded weights large enough that positions and masks matter."""
    g = torch.Generator().manual_seed(seed)

    def randn(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=g)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(randn(module.weight) / math.sqrt(module.in_features))
                if module.bias is not None:
                    module.bias.copy_(0.1 * randn(module.bias))
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(0.5 * randn(module.weight))
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
                module.weight.copy_(1.0 + 0.1 * randn(module.weight))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(0.1 * randn(module.bias))
    return model


PAD = 0


def right_pad(rows: list[torch.Tensor], t: int | None = None) -> torch.Tensor:
    """Rows of token ids -> (len(rows), t), right-padded with PAD (default t: the longest row), on
    the rows' device."""
    t = max(len(r) for r in rows) if t is None else t
    out = torch.full((len(rows), t), PAD, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
