"""Generation over the KV cache: ``step.decode_step`` is THE decode step; ``stream_decoder_only`` and
``stream_encoder_decoder`` the one loop per architecture, which ``greedy_*``, ``generate_decoder_only``
and ``sample_encoder_decoder`` collect; beam search, ensembles, sampling and incremental text."""

from __future__ import annotations

from typing import Any

from aiayn.generate.beam import (
    BeamSearchResult,
    BeamStep,
    beam_search_decoder_only,
    beam_search_encoder_decoder,
    gnmt_length_penalty,
)
from aiayn.generate.decoder_only import (
    generate_decoder_only,
    greedy_decoder_only,
    stream_decoder_only,
)
from aiayn.generate.encoder_decoder import (
    greedy_encoder_decoder,
    max_target_lengths,
    sample_encoder_decoder,
    stream_encoder_decoder,
)
from aiayn.generate.ensemble import Ensemble, mean_log_probs
from aiayn.generate.hypotheses import Hypothesis
from aiayn.generate.results import DecodeStep, GreedyResult
from aiayn.generate.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    filter_logits,
    sample_next,
)
from aiayn.generate.step import decode_step
from aiayn.generate.text import IncrementalText

__all__ = [
    "BeamSearchResult",
    "BeamStep",
    "DecodeStep",
    "Ensemble",
    "GreedyResult",
    "Hypothesis",
    "IncrementalText",
    "SamplingConfig",
    "apply_repetition_penalty",
    "beam_search_decoder_only",
    "beam_search_encoder_decoder",
    "compiled_decode_step",
    "decode_step",
    "filter_logits",
    "generate_decoder_only",
    "gnmt_length_penalty",
    "greedy_decoder_only",
    "greedy_encoder_decoder",
    "max_target_lengths",
    "mean_log_probs",
    "sample_encoder_decoder",
    "sample_next",
    "stream_decoder_only",
    "stream_encoder_decoder",
]


def __getattr__(name: str) -> Any:
    """``compiled_decode_step``, imported on first access (importing aiayn.generate imports no aiayn.fast)."""
    if name == "compiled_decode_step":
        from aiayn.fast.compiled_decode import compiled_decode_step

        return compiled_decode_step
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
