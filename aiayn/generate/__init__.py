"""Generation: greedy decoding, sampling and beam search, over the KV cache.

* ``step.decode_step``: THE decode step (new tokens in, the next-token logits out) that every loop
  here, ``aiayn serve``'s engine and ``aiayn explore`` call; ``compile=True`` runs it through the
  compiled graph of ``aiayn.fast.compiled_decode``.
* ``text.IncrementalText``: the one incremental detokeniser (held-back half characters and stop
  strings), shared by ``aiayn generate`` and ``aiayn serve``.

* ``stream_decoder_only`` / ``stream_encoder_decoder`` (modules ``decoder_only``,
  ``encoder_decoder``): the one decode loop per architecture, an iterator of ``DecodeStep`` (each
  row's next token and the logits it came from), shared by greedy decoding (``sampling=None``) and
  sampling. Stream from it, or stop it early by leaving the loop.
* ``greedy_decoder_only``, ``generate_decoder_only``, ``greedy_encoder_decoder``,
  ``sample_encoder_decoder``: the loops run to the end, their tokens collected.
* ``sampling``: ``SamplingConfig``, temperature / top-k / top-p and the repetition penalty.
* ``beam``: ``beam_search_encoder_decoder`` and ``beam_search_decoder_only`` with GNMT's length
  penalty (``trace=`` reports every step's candidates as a ``BeamStep``).
* ``ensemble``: ``Ensemble``, several encoder-decoders that the encoder-decoder loops and beam
  search decode as one model (the mean of their log-probabilities, each member on its own cache).

Every loop can run with ``use_cache=False``, recomputing the whole sequence every step: the
reference the cached path is tested against. The compiled decoder-only step lives in
``aiayn.fast.compiled_decode`` and is imported only when asked for (``compile=True``, or the
``compiled_decode_step`` name here).
"""

from __future__ import annotations

from typing import Any

from aiayn.generate.beam import (
    BeamSearchResult,
    BeamStep,
    Hypothesis,
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
from aiayn.generate.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    filter_logits,
    sample_next,
)
from aiayn.generate.step import decode_step
from aiayn.generate.results import DecodeStep, GreedyResult
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
    """``compiled_decode_step`` (``aiayn.fast.compiled_decode``), imported on first access so that
    importing aiayn.generate does not import aiayn.fast."""
    if name == "compiled_decode_step":
        from aiayn.fast.compiled_decode import compiled_decode_step

        return compiled_decode_step
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
