"""Encoder-only model (BERT): bidirectional stack, segment embeddings, pooler and MLM head."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.models.base import check_arch, init_weights
from aiayn.models.blocks import TransformerStack
from aiayn.nn.mlp import ACTIVATIONS
from aiayn.nn.norm import make_norm


@dataclass
class EncoderOnlyOutput:
    hidden: Tensor  # (b, t, d) contextual token vectors
    pooled: Tensor  # (b, d) tanh(W h_[CLS] + b), BERT's sentence vector
    mlm_logits: Tensor | None  # (b, t, v) masked-token predictions, if asked for
    attentions: list[Tensor] = field(default_factory=list)


class EncoderOnly(nn.Module):
    """tokens (b, t) [+ segments (b, t)] -> hidden (b, t, d), pooled (b, d), MLM logits (b, t, v)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_arch(config, "encoder-only", "EncoderOnly")
        self.config = config
        embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = TransformerStack(config, n_layers=config.n_layers, embedding=embedding,
                                        causal=False, segments=True)
        self.pooler = nn.Linear(config.d_model, config.d_model)
        # MLM head (BERT): transform (dense + activation + norm), then project to the vocabulary.
        self.mlm_dense = nn.Linear(config.d_model, config.d_model)
        self.mlm_act = ACTIVATIONS["gelu" if config.activation in ("swiglu", "geglu") else config.activation]
        self.mlm_norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.mlm_head = nn.Linear(config.d_model, config.vocab_size, bias=True)
        init_weights(self, config)
        if config.tie_output:
            self.mlm_head.weight = embedding.weight

    @property
    def embedding(self) -> nn.Embedding:
        return self.encoder.embedding

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """hidden (b, t, d) -> (b, t, v)"""
        return self.mlm_head(self.mlm_norm(self.mlm_act(self.mlm_dense(hidden))))

    def forward(
        self,
        tokens: Tensor,
        *,
        valid: Tensor | None = None,
        segments: Tensor | None = None,
        with_mlm_logits: bool = True,
        need_weights: bool = False,
    ) -> EncoderOnlyOutput:
        # Padding-free (config.padding_free): the stack and the MLM head run on the real tokens
        # only, (n, d); hidden and logits come back padded, zeros at padding.
        pack = self.config.padding_free and not need_weights
        out = self.encoder(tokens, valid=valid, segments=segments, need_weights=need_weights, pack=pack)
        unpack = out.packing.unpack if out.packing is not None else (lambda x: x)
        hidden = unpack(out.hidden)  # (b, t, d)
        pooled = torch.tanh(self.pooler(hidden[:, 0]))  # (b, d) from the first ([CLS]) token
        logits = unpack(self.mlm_logits(out.hidden)) if with_mlm_logits else None
        return EncoderOnlyOutput(hidden=hidden, pooled=pooled, mlm_logits=logits,
                                 attentions=out.attentions)
