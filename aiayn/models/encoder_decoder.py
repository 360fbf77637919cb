"""The paper's model: encoder stack, decoder stack with cross-attention, output projection."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.models.base import ModelOutput, finish_model, make_cache, model_output, start_model
from aiayn.models.blocks import TransformerStack
from aiayn.nn.kv_cache import KVCache


@dataclass
class Encoded:
    memory: Tensor  # (b, s, d) encoder output
    valid: Tensor  # (b, s) bool, True at real source tokens
    attentions: list[Tensor] = field(default_factory=list)


class EncoderDecoder(nn.Module):
    """source (b, s), target (b, t) -> logits (b, t, v_tgt) for the next target token;
    ``share_embeddings`` and ``tie_output`` share the embedding matrices (paper section 3.4)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        src_embedding = start_model(self, config, "encoder-decoder")
        tgt_embedding = (src_embedding if config.share_embeddings
                         else nn.Embedding(config.tgt_vocab_size, config.d_model))
        self.encoder = TransformerStack(config, n_layers=config.n_layers, embedding=src_embedding,
                                        causal=False)
        self.decoder = TransformerStack(config, n_layers=config.n_decoder_layers,
                                        embedding=tgt_embedding, causal=True, cross_attention=True)
        self.lm_head = nn.Linear(config.d_model, config.tgt_vocab_size, bias=config.lm_head_bias)
        finish_model(self, config, self.lm_head, tgt_embedding)

    def encode(self, src: Tensor, *, src_valid: Tensor | None = None,
               need_weights: bool = False) -> Encoded:
        """src (b, s) -> memory (b, s, d)."""
        out = self.encoder(src, valid=src_valid, need_weights=need_weights)
        return Encoded(memory=out.hidden, valid=out.valid, attentions=out.attentions)

    def decode(self, tgt: Tensor, encoded: Encoded, *, tgt_valid: Tensor | None = None,
               cache: KVCache | None = None, need_weights: bool = False) -> ModelOutput:
        """tgt (b, t) -> logits (b, t, v_tgt) over the encoded source, continuing ``cache`` if given."""
        out = self.decoder(tgt, valid=tgt_valid, memory=encoded.memory, memory_valid=encoded.valid,
                           cache=cache, need_weights=need_weights)
        return model_output(out, self.lm_head, encoder_attentions=encoded.attentions)

    def forward(self, src: Tensor, tgt: Tensor, *, src_valid: Tensor | None = None,
                tgt_valid: Tensor | None = None, need_weights: bool = False) -> ModelOutput:
        """Teacher-forced pass: src (b, s), tgt (b, t) -> logits (b, t, v_tgt)."""
        if src.dim() == 2 and tgt.dim() == 2 and src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src and tgt batch sizes differ: src {tuple(src.shape)}, "
                             f"tgt {tuple(tgt.shape)}")
        if self.config.padding_free and not need_weights:
            # Both stacks packed: the source's real tokens feed the cross-attention projections.
            enc = self.encoder(src, valid=src_valid, pack=True)
            out = self.decoder(tgt, valid=tgt_valid, memory=enc.hidden, memory_valid=enc.valid,
                               memory_packing=enc.packing, pack=True)
            return model_output(out, self.lm_head)
        encoded = self.encode(src, src_valid=src_valid, need_weights=need_weights)
        return self.decode(tgt, encoded, tgt_valid=tgt_valid, need_weights=need_weights)

    def new_cache(self, batch_size: int, max_len: int | None = None, *,
                  dtype: torch.dtype | None = None, quantize: str | None = None,
                  group_size: int | None = None) -> KVCache:
        """A preallocated decoder KV cache (self-attention buffers + cross-attention slots)."""
        weight = self.lm_head.weight
        return make_cache(self.config, n_layers=self.config.n_decoder_layers, batch_size=batch_size,
                          max_len=max_len, dtype=dtype or weight.dtype, device=weight.device,
                          cross_attention=True, quantize=quantize, group_size=group_size)
