"""THE decode step: new tokens in, next-token logits out, for every decode loop, ``aiayn serve`` and
``aiayn explore``; ``decode_ragged`` is the same step over several batches in one pass.

Shape letters: b rows, t new tokens per row, d d_model, v vocabulary, m positions asked for."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from aiayn.generate.ensemble import Ensemble, EnsembleCache, mean_log_probs
from aiayn.models.blocks import RaggedBatch
from aiayn.models.decoder_only import DecoderOnly
from aiayn.models.encoder_decoder import EncoderDecoder
from aiayn.models.step import StepInput, logits_at, run_step
from aiayn.nn.kv_cache import KVCache


def decode_step(model: nn.Module, tokens: Tensor, cache: KVCache | EnsembleCache, *, valid: Tensor | None = None,
                memory: Tensor | tuple[Tensor, ...] | None = None, memory_valid: Tensor | None = None,
                at: tuple[Tensor, Tensor] | None = None, compile: bool = False) -> Tensor:
    """tokens (b, t) continuing ``cache`` -> logits (b, v) of each row's last position, or (m, v) at
    ``at`` = (rows (m,), positions (m,)). An encoder-decoder's first step takes ``memory`` (b, s, d),
    filling the cache's cross-attention k/v; ``memory_valid`` (b, s) its real tokens. compile: one
    token per row, compiled. An ``Ensemble`` returns its members' mean log-probabilities."""
    if isinstance(model, Ensemble):
        if not isinstance(cache, EnsembleCache) or isinstance(memory, Tensor):
            raise TypeError("an Ensemble decodes over its own new_cache() and encode().memory (one per member)")
        memories = memory if memory is not None else (None,) * len(model)
        return mean_log_probs([
            decode_step(member, tokens, member_cache, valid=valid, memory=member_memory,
                        memory_valid=memory_valid, at=at, compile=compile)
            for member, member_cache, member_memory in zip(model.members, cache.members, memories, strict=True)])
    if compile:
        if at is not None or valid is not None or memory is not None:
            raise ValueError("the compiled decode step takes one real token per row after the first step; "
                             "drop compile for prompts, padding or the step that reads an encoder's memory")
        from aiayn.fast.compiled_decode import compiled_decode_step

        return compiled_decode_step(model, tokens, cache, memory_valid=memory_valid)  # type: ignore[arg-type]
    if isinstance(model, EncoderDecoder) and valid is None:
        valid = torch.ones_like(tokens, dtype=torch.bool)  # generated target tokens are real, even pad_id
    inputs = model.decoder.prepare(tokens, valid=valid, memory=memory, memory_valid=memory_valid, cache=cache)
    return run_step(model, StepInput(tokens, inputs, at), cache)  # (b, v) or (m, v)


def decode_ragged(model: nn.Module, batches: Sequence[RaggedBatch], at: Tensor) -> Tensor:
    """Several right-padded batches over their own per-row caches, one decoder-only pass -> logits (m, v)
    at ``at`` (m,) (indices into the real tokens, packed batch after batch), each as ``decode_step``'s."""
    if not isinstance(model, DecoderOnly):
        raise TypeError("decode_ragged runs a decoder-only model (the serve engine's)")
    hidden, _ = model.decoder.forward_ragged(batches)  # (n, d)
    return logits_at(model, hidden, at)  # (m, v)
