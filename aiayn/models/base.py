"""What the three model classes share: their one output type, weight initialisation, cache factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.models.blocks import StackOutput
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.packing import Packing
from aiayn.nn.paged_kv_cache import PagedKVCache


@dataclass
class ModelOutput:
    """What every model of the family returns: the last stack's hidden states, and ``logits`` (b, t, v) =
    ``head(hidden)`` computed on first access. Padding-free, ``hidden_rows`` are the real tokens (n, d)
    placed by ``packing``; ``hidden`` and ``logits`` are (b, t, ...) all the same, zeros at padding."""

    hidden_rows: Tensor  # the last stack's output (after its final norm): (b, t, d), or packed (n, d)
    head: Callable[[Tensor], Tensor]  # the output layer: (..., d) -> (..., v)
    packing: Packing | None = None  # set when hidden_rows are packed (padding-free)
    attentions: list[Tensor] = field(default_factory=list)  # self-attention weights per layer, on request
    cross_attentions: list[Tensor] = field(default_factory=list)  # decoder cross-attention, per layer
    encoder_attentions: list[Tensor] = field(default_factory=list)  # encoder self-attention (enc-dec)
    pooled: Tensor | None = None  # (b, d) an encoder's sentence vector (BERT's pooler)
    # hidden and logits once computed (plain attributes: torch.compile cannot trace cached_property)
    _hidden: Tensor | None = field(default=None, repr=False, compare=False)
    _logits: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def hidden(self) -> Tensor:
        """(b, t, d)"""
        if self._hidden is None:
            self._hidden = self.unpack(self.hidden_rows)
        return self._hidden

    @property
    def logits(self) -> Tensor:
        """(b, t, v)"""
        if self._logits is None:
            self._logits = self.unpack(self.head(self.hidden_rows))
        return self._logits

    def unpack(self, rows: Tensor) -> Tensor:
        """Rows in ``hidden_rows``' layout -> (b, t, ...), zeros at padding if they are packed."""
        return self.packing.unpack(rows) if self.packing is not None else rows


def model_output(out: StackOutput, head: Callable[[Tensor], Tensor], **extra: object) -> ModelOutput:
    """A stack's output with the output layer that turns it into logits."""
    return ModelOutput(hidden_rows=out.hidden, head=head, packing=out.packing, attentions=out.attentions,
                       cross_attentions=out.cross_attentions, **extra)  # type: ignore[arg-type]


def init_weights(model: nn.Module, config: ModelConfig) -> None:
    """Post-norm (the paper's): Xavier-uniform projections and N(0, d^-1/2) embeddings, which the sqrt(d)
    scale brings to unit size. Pre-norm (GPT-2): N(0, 0.02). Biases start at zero, norms at identity."""
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
               quantize: str | None = None, group_size: int | None = None, per_row: bool = False,
               n_blocks: int | None = None, block_size: int = 16) -> KVCache:
    max_len = config.max_seq_len if max_len is None else max_len
    if n_blocks is not None:  # paged: rows over a pool of n_blocks blocks
        return PagedKVCache(n_layers=n_layers, batch_size=batch_size, n_kv_heads=config.n_kv_heads,
                            head_dim=config.head_dim, max_len=max_len, n_blocks=n_blocks, block_size=block_size,
                            dtype=dtype, device=device, quantize=quantize)
    return KVCache(n_layers=n_layers, batch_size=batch_size, n_kv_heads=config.n_kv_heads,
                   head_dim=config.head_dim, max_len=max_len, dtype=dtype, device=device,
                   cross_attention=cross_attention, quantize=quantize, group_size=group_size, per_row=per_row)


def start_model(model: nn.Module, config: ModelConfig, arch: str) -> nn.Embedding:
    """A model class's first step: check ``arch``, keep the config, make the (source) embedding table."""
    if config.arch != arch:
        raise ValueError(f"{type(model).__name__} needs config.arch={arch!r}, got {config.arch!r}; "
                         f"use aiayn.models.build_model(config) to pick the class")
    model.config = config
    return nn.Embedding(config.vocab_size, config.d_model)


def finish_model(model: nn.Module, config: ModelConfig, head: nn.Linear, embedding: nn.Embedding) -> None:
    """A model class's last step: initialise its weights, then tie its output layer (``tie_output``)."""
    init_weights(model, config)
    if config.tie_output:
        head.weight = embedding.weight


