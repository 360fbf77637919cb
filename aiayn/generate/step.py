"""THE decode step: new tokens in, next-token logits out.

``decode_step`` runs a model's decoder on the new tokens of each row into its KV cache and applies
the output layer at the positions whose next token is wanted (each row's last, by default): it
builds the step's input (``TransformerStack.prepare``) and runs ``aiayn.models.step.run_step``.
Greedy decoding, sampling and beam search (both architectures), ``aiayn serve``'s engine (its
prefill chunks and decode steps over a per-row cache) and ``aiayn explore`` all call it;
``compile=True`` runs the same step through ``aiayn.fast.compiled_decode`` (one token per row over a
float cache, of a decoder-only model or of an encoder-decoder's decoder after its first step: the
graph torch.compile traces once per shape).

``decode_ragged`` is the same step over several batches at once (the serve engine's step that
decodes its running rows and feeds a prompt chunk together): one pass over the weights.

Shape letters: b rows, t new tokens per row, d d_model, v vocabulary, m positions asked for.
"""

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
    """tokens (b, t) continuing ``cache`` -> logits (b, v) of each row's last position, or (m, v) of
    the positions ``at`` = (rows (m,), positions (m,)) names.

    A decoder-only model (``DecoderOnly``) or an encoder-decoder (``EncoderDecoder``: its decoder,
    cross-attending to ``memory`` (b, s, d) on the first step, which fills the cache's
    cross-attention keys and values, and to those afterwards; ``memory_valid`` (b, s) marks the
    real source tokens every step).
    valid (b, t) bool: the real new tokens (left-padded prompts; a serve prefill chunk's ragged
        rows). Default: the model's rule for a decoder-only model (``tokens != pad_id``), all real
        for an encoder-decoder's target (a generated token equal to pad_id is still real).
    compile: one token per row through the model's compiled graph
        (``aiayn.fast.compiled_decode.compiled_decode_step``; float cache, eval mode): a
        decoder-only model, or an encoder-decoder after its first step (``memory_valid`` given,
        the cross-attention keys and values in the cache).

    An ``Ensemble`` (``aiayn.generate.ensemble``; its ``EnsembleCache``, and ``memory`` a tuple of
    its members' encoder outputs) runs this step for every member, on the member's own memory and
    cache, and returns the mean of their log-probabilities (b, v) or (m, v): valid logits for
    every loop (that module's docstring says why).
    """
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
    if isinstance(model, EncoderDecoder):
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        inputs = model.decoder.prepare(tokens, valid=valid, memory=memory, memory_valid=memory_valid, cache=cache)
    else:
        inputs = model.decoder.prepare(tokens, valid=valid, cache=cache)
    return run_step(model, StepInput(tokens, inputs, at), cache)  # (b, v) or (m, v)


def decode_ragged(model: nn.Module, batches: Sequence[RaggedBatch], at: Tensor) -> Tensor:
    """Several batches of new tokens, each right-padded over its own per-row cache (view), through
    a decoder-only model in one pass (``TransformerStack.forward_ragged``) -> logits (m, v) of the
    tokens ``at`` (m,) names: indices into the batches' real tokens, packed batch after batch
    (batch 0's rows' tokens first, row by row). Each batch's logits equal ``decode_step`` on it
    alone; the weights are read once for all of them."""
    if not isinstance(model, DecoderOnly):
        raise TypeError("decode_ragged runs a decoder-only model (the serve engine's)")
    hidden, _ = model.decoder.forward_ragged(batches)  # (n, d)
    return logits_at(model, hidden, at)  # (m, v)
