"""Normalisation layers: LayerNorm (paper, BERT, GPT-2) and RMSNorm (T5, LLaMA), torch's own;
RMSNorm drops the mean and the bias: y = x / sqrt(mean(x^2) + eps) * g."""

from __future__ import annotations

from torch import nn

NORM_TYPES = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


def make_norm(kind: str, d_model: int, eps: float = 1e-5) -> nn.Module:
    """A normalisation layer over the last dimension of width ``d_model``."""
    try:
        return NORM_TYPES[kind](d_model, eps=eps)
    except KeyError:
        raise ValueError(f"unknown norm {kind!r}; choose one of {', '.join(NORM_TYPES)}") from None
