"""Sampling: temperature, top-k, top-p, repetition penalty; streaming generation over the cache."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from aiayn import build_model, get_preset
from aiayn.generate import (
    SamplingConfig,
    apply_repetition_penalty,
    filter_logits,
    generate_decoder_only,
    greedy_decoder_only,
    sample_next,
)


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0]])
    kept = filter_logits(logits, top_k=2, top_p=None)
    assert torch.isfinite(kept).tolist() == [[False, True, False, True]]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, top_k=None, top_p=0.5)).tolist() == [[False, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=None, top_p=0.75)).tolist() == [[False, True, False, True]]
    assert torch.isfinite(filter_logits(logits, top_k=None, top_p=0.81)).tolist() == [[False, True, True, True]]
    assert torch.isfinite(filter_logits(logits, top_k=None, top_p=1.0)).all()


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1]]), 2.0)
    assert_close(out, torch.tensor([[1.0, -4.0, 1.0]]))


def test_temperature_zero_is_argmax_and_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    assert sample_next(logits, torch.zeros(1, 1, dtype=torch.long), SamplingConfig(temperature=0)).item() == 2
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, torch.zeros(1, 1, dtype=torch.long), SamplingConfig(),
                                     generator) for _ in range(4000)]).flatten()
    frequencies = torch.bincount(draws, minlength=3).float() / len(draws)
    assert_close(frequencies, torch.softmax(logits[0], -1), atol=0.03, rtol=0)


@pytest.mark.parametrize(("field", "value"), [("temperature", -1.0), ("top_k", 0), ("top_p", 0.0),
                                              ("top_p", 1.5), ("repetition_penalty", 0.0)])
def test_bad_sampling_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value})


def test_generation_streams_stops_and_is_seeded():
    model = build_model(get_preset("llama-tiny")).eval()
    prompt = torch.randint(0, 99, (2, 5))
    greedy = generate_decoder_only(model, prompt, max_new_tokens=8, sampling=SamplingConfig(temperature=0))
    assert torch.equal(greedy, greedy_decoder_only(model, prompt, max_new_tokens=8).tokens)
    cfg = SamplingConfig(temperature=1.0, top_k=10, seed=3)
    assert torch.equal(generate_decoder_only(model, prompt, max_new_tokens=8, sampling=cfg),
                       generate_decoder_only(model, prompt, max_new_tokens=8, sampling=cfg))
    seen: list[torch.Tensor] = []
    out = generate_decoder_only(model, prompt, max_new_tokens=8, sampling=cfg,
                                on_token=lambda t: seen.append(t) or len(seen) == 3)
    assert out.shape == (2, 3) and torch.equal(torch.stack(seen, 1), out)
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        generate_decoder_only(model, prompt, max_new_tokens=60, slide=False)


def test_generation_checks_prompt_valid():
    model = build_model(get_preset("llama-tiny")).eval()
    prompt = torch.randint(0, 99, (2, 5))
    with pytest.raises(ValueError, match="prompt_valid must be a bool tensor of the prompt's shape"):
        generate_decoder_only(model, prompt, max_new_tokens=2, prompt_valid=torch.ones(2, 4, dtype=torch.bool))
    no_real = torch.ones(2, 5, dtype=torch.bool)
    no_real[1] = False
    with pytest.raises(ValueError, match="has no real token"):
        generate_decoder_only(model, prompt, max_new_tokens=2, prompt_valid=no_real)
