"""What the three model classes share: their output type, weight initialisation, cache factory."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.models.blocks import StackOutput
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.packing import Packing


@dataclass
class ModelOutput:
    logits: Tensor  # (b, t, v)
    hidden: Tensor  # (b, t, d), the last stack's output (after its final norm)
    attentions: list[Tensor] = field(default_factory=list)  # decoder/encoder self-attn, per layer
    cross_attentions: list[Tensor] = field(default_factory=list)  # decoder cross-attn, per layer
    encoder_attentions: list[Tensor] = field(default_factory=list)  # encoder self-attn (enc-dec)


class PackedModelOutput(ModelOutput):
    """A padding-free forward's output (``ModelConfig.padding_free``): computed for the real tokens
    only. ``packed_logits`` (n, v) and ``packed_hidden`` (n, d) are those rows, in row-major order
    of the (b, t) batch (``packing.index``); ``logits`` and ``hidden`` unpack them to (b, t, ...),
    zeros at padding, on first access. A loss over real tokens can take ``packed_logits`` with
    ``targets.reshape(-1)[packing.index]`` and skip the padded rows altogether.
    """

    def __init__(self, packing: Packing, packed_logits: Tensor, packed_hidden: Tensor) -> None:
        self.packing, self.packed_logits, self.packed_hidden = packing, packed_logits, packed_hidden
        self.attentions, self.cross_attentions, self.encoder_attentions = [], [], []

    @functools.cached_property
    def logits(self) -> Tensor:  # type: ignore[override]
        return self.packing.unpack(self.packed_logits)

    @functools.cached_property
    def hidden(self) -> Tensor:  # type: ignore[override]
        return self.packing.unpack(self.packed_hidden)


def model_output(out: StackOutput, head: nn.Module) -> ModelOutput:
    """A stack's output and the output head applied to it, packed if the stack ran padding-free."""
    if out.packing is not None:
        return PackedModelOutput(out.packing, head(out.hidden), out.hidden)
    return ModelOutput(logits=head(out.hidden), hidden=out.hidden, attentions=out.attentions)


def init_weights(model: nn.Module, config: ModelConfig) -> None:
    """Post-norm models (the paper's): Xavier-uniform projections, as the reference implementations
    do, and N(0, d^-1/2) embeddings, which the sqrt(d) embedding scale brings to unit size.
    Pre-norm models (GPT-2 style): N(0, 0.02) everywhere. Biases start at zero, norms at identity.
    """
    pre = config.norm_position == "pre"
    emb_std = 0.02 if pre or not config.scale_embeddings else config.d_model**-0.5
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if pre:
                nn.init.normal_(module.weight, std=0.02)
            else:
                nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=emb_std)


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def make_cache(config: ModelConfig, *, n_layers: int, batch_size: int, max_len: int | None,
               dtype: torch.dtype, device: torch.device, cross_attention: bool,
               quantize: str | None = None, group_size: int | None = None) -> KVCache:
    max_len = config.max_seq_len if max_len is None else max_len
    return KVCache(n_layers=n_layers, batch_size=batch_size, n_kv_heads=config.kv_heads,
                   head_dim=config.head_size, max_len=max_len, dtype=dtype, device=device,
                   cross_attention=cross_attention, quantize=quantize, group_size=group_size)


def check_arch(config: ModelConfig, expected: str, cls: str) -> None:
    if config.arch != expected:
        raise ValueError(f"{cls} needs config.arch={expected!r}, got {config.arch!r}; "
                         f"use aiayn.models.build_model(config) to pick the class")


