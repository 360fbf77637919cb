"""Beam search through the compiled decode step (``compile=True``) finds the eager search's
hypotheses, for both architectures, over static shapes, with one graph for every step.

The compiled search keeps every source's rows to the end (a stopped source's beams are masked, not
dropped) and follows the kept beams in the cache's own buffers (``reorder_rows_in_place``), so its
bookkeeping differs from the eager search's, which drops stopped sources; the decode step differs
by Inductor's float rounding. So: the same n-best hypotheses, token for token, and their scores
equal at ``assert_close``'s float32 tolerances. The models are the beam tests' own (peaked
distributions, an eos made likely so that sources stop at different steps and the stopping rule
decides). Compiling takes tens of seconds per model and batch size.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from test_beam_decoder_only import model_ as decoder_only_model
from test_beam_decoder_only import prompts
from test_beam_search import model_ as encoder_decoder_model
from test_beam_search import sources
from torch._dynamo.utils import counters
from torch.testing import assert_close

from aiayn.fast import compiled_decode
from aiayn.generate import (
    BeamSearchResult,
    Ensemble,
    beam_search_decoder_only,
    beam_search_encoder_decoder,
    greedy_encoder_decoder,
)
from aiayn.generate.step import decode_step
from aiayn.models import EncoderDecoder

BOS, EOS = 1, 77


def assert_same_search(compiled: BeamSearchResult, eager: BeamSearchResult) -> None:
    """The same best hypotheses and n-best lists, token for token; scores equal up to rounding."""
    assert torch.equal(compiled.tokens, eager.tokens)
    assert torch.equal(compiled.lengths, eager.lengths)
    assert_close(compiled.scores, eager.scores)
    assert_close(compiled.normalized_scores, eager.normalized_scores)
    assert [len(n) for n in compiled.nbest] == [len(n) for n in eager.nbest]
    for ours, theirs in zip(compiled.nbest, eager.nbest, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist()
            # float32 sums read back as Python floats: compared as the float32 values they are
            assert_close(torch.tensor([a.score, a.normalized_score]), torch.tensor([b.score, b.normalized_score]))
            assert_close(a.token_scores, b.token_scores)


# One model per device for the encoder-decoder searches (the translation model's sinusoids): each
# compiled graph (a model, batch size and layout) costs tens of seconds, so the tests share them.
_TRANSLATION_MODELS: dict[str, EncoderDecoder] = {}


def translation_model(device: torch.device) -> EncoderDecoder:
    if str(device) not in _TRANSLATION_MODELS:
        _TRANSLATION_MODELS[str(device)] = encoder_decoder_model("sinusoidal", eos_boost=(EOS, 3.0), device=device)
    return _TRANSLATION_MODELS[str(device)]


SEARCH = dict(bos_id=BOS, eos_id=EOS, beam_size=3, max_len_b=12, n_best=3)  # 4 sources: 12 rows


def test_compiled_translation_search_equals_eager_with_one_graph(device: torch.device,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The translation search (encoder-decoder, padded sources of different lengths that stop at
    different steps) under several stopping rules and length penalties; the first search compiles
    at most one graph, and the later ones (other source lengths, other step counts) none. With the
    stop read a step late (a GPU's ``DoneCheck``, forced here), the same search."""
    from aiayn.generate import results as results_module

    model = translation_model(device)
    settings = [dict(length_penalty=0.6), dict(length_penalty=0.0, early_stopping=True),
                dict(length_penalty=1.0, min_len=3)]
    batches = [sources(device=device), sources((4, 11, 3, 6), seed=5, device=device)]
    before = counters["stats"]["unique_graphs"]
    for i, (src, setting) in enumerate([(batches[0], settings[0]), *[(batches[1], s) for s in settings]]):
        eager = beam_search_encoder_decoder(model, src, **SEARCH, **setting)
        compiled = beam_search_encoder_decoder(model, src, **SEARCH, **setting, compile=True)
        assert_same_search(compiled, eager)
        monkeypatch.setattr(results_module, "LAGGED_DONE_DEVICES", (device.type,))
        assert_same_search(beam_search_encoder_decoder(model, src, **SEARCH, **setting, compile=True), eager)
        monkeypatch.setattr(results_module, "LAGGED_DONE_DEVICES", ())
        if i == 0:
            after_first = counters["stats"]["unique_graphs"]
            assert after_first - before <= 1
            assert len(set(eager.lengths.tolist())) > 1  # the sources stopped at different steps
    assert counters["stats"]["unique_graphs"] == after_first


@pytest.mark.slow
def test_compiled_ensemble_search_equals_eager(device: torch.device) -> None:
    """An ensemble's members each run their compiled step on their own cache, reordered in place
    (the same model twice: its graph is the translation test's)."""
    model = translation_model(device)
    ensemble, src = Ensemble([model, model]).eval(), sources(device=device)
    eager = beam_search_encoder_decoder(ensemble, src, **SEARCH)
    assert_same_search(beam_search_encoder_decoder(ensemble, src, **SEARCH, compile=True), eager)


@pytest.mark.slow
def test_compiled_greedy_translation_equals_eager(device: torch.device) -> None:
    """Greedy translation feeds each step a view of its growing target (another stride every
    step): still one graph for all steps."""
    model, src = translation_model(device), sources(device=device)
    eager = greedy_encoder_decoder(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=14)
    before = counters["stats"]["unique_graphs"]
    compiled = greedy_encoder_decoder(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=14, compile=True)
    assert counters["stats"]["unique_graphs"] - before <= 1
    assert torch.equal(compiled.tokens, eager.tokens) and torch.equal(compiled.lengths, eager.lengths)
    assert_close(compiled.logits, eager.logits)


@pytest.mark.slow
def test_the_whole_buffer_layout_equals_eager(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search over the layout a GPU's compiled step uses (attention over every cache slot under
    the validity mask: static shapes for CUDA graphs), on whatever device the tests run; a model
    with rotary positions and grouped keys and values."""
    monkeypatch.setattr(compiled_decode, "WHOLE_BUFFER_DEVICES", (device.type,))
    model, src = encoder_decoder_model("rope", n_kv_heads=2, eos_boost=(EOS, 2.0), device=device), sources(device=device)
    eager = beam_search_encoder_decoder(model, src, **SEARCH)
    assert_same_search(beam_search_encoder_decoder(model, src, **SEARCH, compile=True), eager)
    compiled_decode.forget_compiled(model)  # its graph is the whole buffer's


@pytest.mark.slow
def test_compiled_decoder_only_search_equals_eager(device: torch.device) -> None:
    """The decoder-only search on left-padded prompts, eos 40 (hypotheses of several lengths)."""
    model, (tokens, valid) = decoder_only_model(seed=2, device=device), prompts(seed=3, device=device)
    for alpha in (0.6, 0.0):
        kwargs = dict(prompt_valid=valid, eos_id=40, max_new_tokens=8, beam_size=4, n_best=4, length_penalty=alpha)
        eager = beam_search_decoder_only(model, tokens, **kwargs)
        assert_same_search(beam_search_decoder_only(model, tokens, **kwargs, compile=True), eager)


def test_the_compiled_step_of_an_encoder_decoder_is_one_graph(device: torch.device) -> None:
    """What the compiled step traces (``_static_step``, cross-attention over a padded source
    included), counted by ``torch._dynamo.explain``: no graph break."""
    from aiayn.fast import matvec

    matvec.mark_for_compile()  # what compiling the step does first (the thread count as a constant)
    model, src = encoder_decoder_model("t5", device=device), sources(device=device)
    with torch.inference_mode():
        encoded = model.encode(src)
        cache = model.new_cache(src.shape[0], 8)
        bos = torch.full((src.shape[0], 1), BOS, device=device)
        decode_step(model, bos, cache, memory=encoded.memory, memory_valid=encoded.valid)  # fills cross k/v
        positions = cache.next_positions()[:, None]  # (b, 1)
        slot = torch.tensor([cache.reserve(torch.ones_like(bos, dtype=torch.bool), positions).start], device=device)
        n = cache.length
        dynamo.reset()
        explained = dynamo.explain(compiled_decode._static_step)(
            model, bos, positions, slot, cache.valid[:, :n], cache.positions[:, :n], cache, encoded.valid)
        dynamo.reset()
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_search_refuses_what_it_cannot_do(device: torch.device) -> None:
    model, src = encoder_decoder_model("t5", device=device), sources(device=device)
    with pytest.raises(ValueError, match="drop compile to trace"):
        beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=EOS, compile=True, trace=lambda step: None)
    with torch.inference_mode():
        encoded = model.encode(src)
        cache = model.new_cache(src.shape[0], 8)
        bos = torch.full((src.shape[0], 1), BOS, device=device)
        with pytest.raises(ValueError, match="cross-attention keys and values are filled"):
            compiled_decode.compiled_decode_step(model, bos, cache, memory_valid=encoded.valid)
        with pytest.raises(ValueError, match="after the first step"):
            decode_step(model, bos, cache, memory=encoded.memory, memory_valid=encoded.valid, compile=True)
        decode_step(model, bos, cache, memory=encoded.memory, memory_valid=encoded.valid)
        with pytest.raises(ValueError, match="needs memory_valid"):
            compiled_decode.compiled_decode_step(model, bos, cache)
        with pytest.raises(ValueError, match="memory_valid must be"):
            compiled_decode.compiled_decode_step(model, bos, cache, memory_valid=encoded.valid[:, :2])
        with pytest.raises(ValueError, match="keeps the batch"):
            compiled_decode.reorder_rows_in_place(cache, torch.arange(2, device=device))
