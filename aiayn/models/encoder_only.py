"""Encoder-only model (BERT): bidirectional stack, segment embeddings, pooler and MLM head."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.models.base import ModelOutput, finish_model, model_output, start_model
from aiayn.models.blocks import TransformerStack
from aiayn.nn.mlp import activation_function
from aiayn.nn.norm import make_norm


class EncoderOnly(nn.Module):
    """tokens (b, t) [+ segments (b, t)] -> hidden (b, t, d), pooled (b, d), MLM logits (b, t, v)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        embedding = start_model(self, config, "encoder-only")
        self.encoder = TransformerStack(config, n_layers=config.n_layers, embedding=embedding,
                                        causal=False, segments=True)
        self.pooler = nn.Linear(config.d_model, config.d_model)
        # MLM head (BERT): transform (dense + activation + norm), then project to the vocabulary.
        self.mlm_dense = nn.Linear(config.d_model, config.d_model)
        self.mlm_act = activation_function(config.activation)  # a gated unit's own function (gelu, silu)
        self.mlm_norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.mlm_head = nn.Linear(config.d_model, config.vocab_size, bias=True)
        finish_model(self, config, self.mlm_head, embedding)

    @property
    def embedding(self) -> nn.Embedding:
        return self.encoder.embedding

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """hidden (b, t, d) -> (b, t, v)"""
        return self.mlm_head(self.mlm_norm(self.mlm_act(self.mlm_dense(hidden))))

    def forward(self, tokens: Tensor, *, valid: Tensor | None = None,
                segments: Tensor | None = None, need_weights: bool = False) -> ModelOutput:
        """tokens (b, t) -> hidden (b, t, d), pooled (b, d) and the MLM head's logits (b, t, v);
        padding-free, hidden and logits are zeros at padding."""
        pack = self.config.padding_free and not need_weights
        out = self.encoder(tokens, valid=valid, segments=segments, need_weights=need_weights, pack=pack)
        first = out.packing.unpack(out.hidden)[:, 0] if out.packing is not None else out.hidden[:, 0]
        pooled = torch.tanh(self.pooler(first))  # (b, d) from the first ([CLS]) token
        return model_output(out, self.mlm_logits, pooled=pooled)
