"""Decoder-only language model (GPT, LLaMA): a causal stack and an output projection."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.models.base import ModelOutput, finish_model, make_cache, model_output, start_model
from aiayn.models.blocks import TransformerStack
from aiayn.nn.kv_cache import KVCache


class DecoderOnly(nn.Module):
    """tokens (b, t) -> next-token logits (b, t, v), each position seeing only itself and the past."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        embedding = start_model(self, config, "decoder-only")
        self.decoder = TransformerStack(config, n_layers=config.n_layers, embedding=embedding, causal=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        finish_model(self, config, self.lm_head, embedding)

    @property
    def embedding(self) -> nn.Embedding:
        return self.decoder.embedding

    def forward(self, tokens: Tensor, *, valid: Tensor | None = None,
                positions: Tensor | None = None, cache: KVCache | None = None,
                need_weights: bool = False) -> ModelOutput:
        """tokens (b, t) -> logits (b, t, v), continuing ``cache`` if given (padding-free: zeros at padding)."""
        pack = self.config.padding_free and cache is None and not need_weights
        out = self.decoder(tokens, valid=valid, positions=positions, cache=cache, need_weights=need_weights,
                           pack=pack)
        return model_output(out, self.lm_head)

    def _first_float_parameter(self) -> torch.Tensor | None:
        # The model's float type and device (a packed model's first float parameter is a norm's).
        return next((p for p in self.parameters() if p.is_floating_point()), None)

    @property
    def float_dtype(self) -> torch.dtype:
        """The float type the model computes in (and its KV cache holds): float32 for a packed model."""
        weight = self._first_float_parameter()
        return torch.float32 if weight is None else weight.dtype

    def new_cache(self, batch_size: int, max_len: int | None = None, *,
                  dtype: torch.dtype | None = None, quantize: str | None = None,
                  group_size: int | None = None, per_row: bool = False, n_blocks: int | None = None,
                  block_size: int = 16) -> KVCache:
        """A preallocated KV cache of ``batch_size`` rows of ``max_len`` (default max_seq_len) tokens:
        ``quantize`` "int8"/"int4"; ``per_row``: rows at their own lengths; ``n_blocks``: a ``PagedKVCache``."""
        weight = self._first_float_parameter()
        return make_cache(self.config, n_layers=self.config.n_layers, batch_size=batch_size, max_len=max_len,
                          dtype=dtype or self.float_dtype,
                          device=torch.device("cpu") if weight is None else weight.device,
                          cross_attention=False, quantize=quantize, group_size=group_size,
                          per_row=per_row, n_blocks=n_blocks, block_size=block_size)
