"""Beam search with static bookkeeping and no compile: what a GPU runs (``STATIC_SEARCH_DEVICES``:
stopped sources masked, not dropped, the cache followed in place, the stop read a step late by
``DoneCheck``), so that a search step makes no host-device sync. Forced here on the test's device,
it finds the dropping search's hypotheses for both architectures, ensembles, the stopping rules
and length penalties; on CUDA the number of syncs does not grow with the number of steps.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_beam_decoder_only import model_ as decoder_only_model
from test_beam_decoder_only import prompts
from test_beam_search import model_ as encoder_decoder_model
from test_beam_search import sources
from test_compiled_beam import assert_same_search

from aiayn.generate import Ensemble, beam_search_decoder_only, beam_search_encoder_decoder
from aiayn.generate import results as results_module
from aiayn.generate import static_search as static_module

BOS, EOS = 1, 77
SEARCH = dict(bos_id=BOS, eos_id=EOS, beam_size=3, n_best=3)


def on_gpu_terms(monkeypatch: pytest.MonkeyPatch, device: torch.device, static: bool) -> None:
    """The search as a GPU runs it (``static``) on ``device``, or as the CPU does."""
    monkeypatch.setattr(static_module, "STATIC_SEARCH_DEVICES", (device.type,) if static else ())
    monkeypatch.setattr(results_module, "LAGGED_DONE_DEVICES", (device.type,) if static else ())


@pytest.mark.parametrize("setting", [dict(length_penalty=0.6), dict(length_penalty=0.0, early_stopping=True),
                                     dict(length_penalty=1.0, min_len=3), dict(length_penalty=0.6, keep_greedy=True)],
                         ids=["alpha0.6", "early", "min_len", "keep_greedy"])
def test_the_static_search_finds_the_dropping_searchs_hypotheses(setting: dict, device: torch.device,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Padded sources of different lengths that stop at different steps (the eos made likely)."""
    model = encoder_decoder_model("sinusoidal", eos_boost=(EOS, 3.0), device=device)
    rows: list[int] = []  # the batch of every output projection: beams in the search, not greedy's
    model.lm_head.register_forward_hook(lambda _, args, __: rows.append(args[0].shape[0]))
    for src in (sources(device=device), sources((4, 11, 3, 6), seed=5, device=device)):
        on_gpu_terms(monkeypatch, device, static=False)
        rows.clear()
        dropping = beam_search_encoder_decoder(model, src, **SEARCH, max_len_b=12, **setting)
        assert 0 < min(n for n in rows[1:] if n % 3 == 0) < 12  # stopped sources left the batch
        on_gpu_terms(monkeypatch, device, static=True)
        rows.clear()
        assert_same_search(beam_search_encoder_decoder(model, src, **SEARCH, max_len_b=12, **setting), dropping)
        assert {n for n in rows[1:] if n != 4} == {12}  # every source's beams to the end (4: greedy's rows)
    assert len(set(dropping.lengths.tolist())) > 1  # the sources stopped at different steps


def test_the_static_search_of_an_ensemble_and_of_a_decoder_only_model(device: torch.device,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ensemble = Ensemble([encoder_decoder_model("sinusoidal", eos_boost=(EOS, 3.0), device=device),
                         encoder_decoder_model("sinusoidal", seed=1, eos_boost=(EOS, 2.0), device=device)])
    model, (tokens, valid) = decoder_only_model(seed=2, device=device), prompts(seed=3, device=device)
    results = {}
    for static in (False, True):
        on_gpu_terms(monkeypatch, device, static=static)
        results[static] = (beam_search_encoder_decoder(ensemble, sources(device=device), **SEARCH, max_len_b=12),
                           beam_search_decoder_only(model, tokens, prompt_valid=valid, eos_id=40, max_new_tokens=8,
                                                    beam_size=4, n_best=4, length_penalty=0.6))
    for static_result, dropping in zip(results[True], results[False], strict=True):
        assert_same_search(static_result, dropping)


def test_a_trace_keeps_the_dropping_search(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace names the sources still searching at each step: the dropping search's bookkeeping."""
    on_gpu_terms(monkeypatch, device, static=True)
    model = encoder_decoder_model("sinusoidal", eos_boost=(EOS, 3.0), device=device)
    steps = []
    beam_search_encoder_decoder(model, sources(device=device), **SEARCH, max_len_b=12, trace=steps.append)
    assert steps[-1].sources.shape[0] < 4  # sources left as they stopped


def test_on_cuda_the_syncs_do_not_grow_with_the_steps(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's sync debug mode "warn" counts the searches' host-device syncs: a search of 24 steps
    makes as many as one of 6 (the set-up's and the result's reads, none per step)."""
    if device.type != "cuda":
        pytest.skip("a host-device sync exists on CUDA only")
    model = encoder_decoder_model("t5", device=device)  # no eos boost: every source runs to its limit

    def syncs(max_len_b: int) -> int:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                beam_search_encoder_decoder(model, sources(device=device), **SEARCH, max_len_a=0.0,
                                            max_len_b=max_len_b)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    assert syncs(24) == syncs(6)
