"""Ensemble decoding (``aiayn.generate.ensemble``): several encoder-decoders searched as one over
the mean of their log-probabilities, each on its own encoder output and KV cache.

The proofs: an ensemble of one model decodes as that model (greedy tokens, beam hypotheses and
scores), and so does an ensemble of two copies of it; for two different random models (the
"tiny" preset, different seeds, positions and widths) the first step is exactly the mean of the
members' log_softmax, the cached loop equals recomputing every member's whole target at every step,
sampling with top_k 1 is greedy, beam search's scores equal the teacher-forced log-probabilities of
its tokens under the ensemble, and beam search never returns a lower normalized score than greedy
decoding over the ensemble; members that do not share a vocabulary are refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from random_weights import randomize_, right_pad
from torch.testing import assert_close

from aiayn.generate import (
    Ensemble,
    SamplingConfig,
    beam_search_encoder_decoder,
    decode_step,
    gnmt_length_penalty,
    greedy_encoder_decoder,
    max_target_lengths,
    sample_encoder_decoder,
)
from aiayn.models import DecoderOnly, EncoderDecoder, get_preset

VOCAB, PAD, BOS = 99, 0, 1
EOS = 40


def model_(*, seed: int, device: torch.device, **overrides) -> EncoderDecoder:
    """A tiny encoder-decoder with seeded random weights and peaked output distributions (an untied
    output layer scaled up, eos a little more likely so that hypotheses end), built on the CPU (the
    same weights on every device) and moved to ``device``."""
    torch.manual_seed(seed)
    config = get_preset("tiny", tie_output=False, lm_head_bias=True, **overrides)
    model = randomize_(EncoderDecoder(config), seed).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
        model.lm_head.bias[EOS] += 2.0
    return model.to(device)


def two_models(device: torch.device) -> list[EncoderDecoder]:
    """Two different members: other seeds, positions (T5 biases, sinusoids) and widths."""
    return [model_(seed=0, positional="t5", device=device),
            model_(seed=1, positional="sinusoidal", d_model=32, n_heads=4, device=device)]


def sources(lengths: tuple[int, ...] = (9, 5, 2, 7), *, device: torch.device) -> torch.Tensor:
    """(b, s) right-padded random sources."""
    g = torch.Generator().manual_seed(1)
    return right_pad([torch.randint(3, VOCAB, (n,), generator=g).to(device) for n in lengths])


def teacher_forced(model: EncoderDecoder | Ensemble, src: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs (n,) of target ``tokens`` (n,) given one source row (s,), without any cache: an
    ensemble's ``decode`` is its members' whole forward, averaged, and its log_softmax the
    normalised distribution beam search scores by."""
    src = src[None, : int((src != PAD).sum())]
    tgt = torch.cat([torch.tensor([BOS], device=tokens.device), tokens[:-1]])[None]
    real = torch.ones_like(tgt, dtype=torch.bool)  # generated tokens are real even if one equals pad_id
    with torch.no_grad():
        logits = model.decode(tgt, model.encode(src), tgt_valid=real).logits[0]  # (n, v)
    return torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]


def greedy(model: EncoderDecoder | Ensemble, src: torch.Tensor, *, use_cache: bool = True):
    limits = max_target_lengths(src != PAD, max_len_a=1.0, max_len_b=8, cap=model.config.max_seq_len)
    return greedy_encoder_decoder(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=limits, use_cache=use_cache)


def beam(model: EncoderDecoder | Ensemble, src: torch.Tensor, *, beam_size: int = 4, alpha: float = 0.6,
         keep_greedy: bool = False):
    return beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=EOS, beam_size=beam_size,
                                       length_penalty=alpha, max_len_a=1.0, max_len_b=8, n_best=beam_size,
                                       keep_greedy=keep_greedy)


def assert_same_beams(got, want) -> None:
    """Equal hypotheses (tokens, lengths, n-best lists) and scores equal to float rounding."""
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lengths, want.lengths)
    assert_close(got.scores, want.scores)
    assert_close(got.normalized_scores, want.normalized_scores)
    for got_list, want_list in zip(got.nbest, want.nbest, strict=True):
        assert [h.tokens.tolist() for h in got_list] == [h.tokens.tolist() for h in want_list]
        assert_close(torch.tensor([h.score for h in got_list]), torch.tensor([h.score for h in want_list]))


@pytest.mark.parametrize("copies", [1, 2])
def test_an_ensemble_of_one_model_decodes_as_the_model(copies: int, device: torch.device) -> None:
    """One member, or two copies of one (the mean of equal log-probabilities is themselves): the
    greedy tokens, the beam hypotheses and their scores are the model's."""
    model = model_(seed=0, positional="t5", device=device)
    ensemble = Ensemble([model] + [copy.deepcopy(model) for _ in range(copies - 1)])
    src = sources(device=device)
    alone, together = greedy(model, src), greedy(ensemble, src)
    assert torch.equal(together.tokens, alone.tokens) and torch.equal(together.lengths, alone.lengths)
    assert alone.tokens.shape[1] > 1 and (alone.tokens == EOS).any()  # hypotheses that end, not just one token
    assert_close(torch.log_softmax(together.logits, -1), torch.log_softmax(alone.logits.float(), -1))
    for beam_size in (1, 4):
        assert_same_beams(beam(ensemble, src, beam_size=beam_size), beam(model, src, beam_size=beam_size))


def test_first_step_is_the_mean_of_the_members_log_softmax(device: torch.device) -> None:
    """Two different random models: the ensemble's step on bos is the mean of each member's own
    forward (no cache), log_softmax'ed; the members disagree, so the mean is not either of them."""
    members = two_models(device)
    ensemble = Ensemble(members)
    src = sources(device=device)
    bos = torch.full((src.shape[0], 1), BOS, device=device)
    encoded = ensemble.encode(src)
    assert [m.shape[-1] for m in encoded.memory] == [48, 32]  # each member's own encoder output
    got = decode_step(ensemble, bos, ensemble.new_cache(src.shape[0], 4), memory=encoded.memory,
                      memory_valid=encoded.valid)  # (b, v)
    with torch.no_grad():
        each = [torch.log_softmax(m(src, bos).logits[:, -1].float(), -1) for m in members]  # (b, v) each
    assert (each[0] - each[1]).abs().max() > 1.0  # two different distributions
    assert_close(got, (each[0] + each[1]) / 2)


def test_cached_ensemble_equals_recomputing_every_member(device: torch.device) -> None:
    """Greedy over the members' KV caches equals recomputing every member's whole target every step
    (``use_cache=False``: ``Ensemble.decode``); sampling with top_k 1 chooses as greedy does."""
    ensemble = Ensemble(two_models(device))
    src = sources(device=device)
    cached, recomputed = greedy(ensemble, src), greedy(ensemble, src, use_cache=False)
    assert torch.equal(cached.tokens, recomputed.tokens) and torch.equal(cached.lengths, recomputed.lengths)
    assert cached.tokens.shape[1] > 2
    assert_close(cached.logits, recomputed.logits, rtol=1e-4, atol=1e-4)
    limits = max_target_lengths(src != PAD, max_len_a=1.0, max_len_b=8)
    sampled = sample_encoder_decoder(ensemble, src, bos_id=BOS, eos_id=EOS, max_new_tokens=limits,
                                     sampling=SamplingConfig(temperature=1.0, top_k=1, seed=3))
    assert torch.equal(sampled, cached.tokens)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_ensemble_beam_scores_are_its_log_probs_and_never_below_greedy(alpha: float, device: torch.device) -> None:
    """Every returned hypothesis's score is the teacher-forced, cache-free log-probability of its
    tokens under the ensemble (the cache reordered across beams and dropped sources equals
    recomputation); with the greedy hypothesis kept (the translator's default) the best normalized
    score is never below greedy decoding's, scored under the ensemble."""
    ensemble = Ensemble(two_models(device))
    src = sources(device=device)
    found = greedy(ensemble, src)
    for beam_size in (2, 3, 5):
        result = beam(ensemble, src, beam_size=beam_size, alpha=alpha, keep_greedy=True)
        for i in range(src.shape[0]):
            for hyp in result.nbest[i]:
                lp = teacher_forced(ensemble, src[i], hyp.tokens)
                assert_close(torch.tensor(hyp.score), lp.sum().cpu(), rtol=1e-4, atol=1e-4)
                assert_close(hyp.token_scores.cpu(), lp.cpu(), rtol=1e-4, atol=1e-4)
            tokens = found.tokens[i, : int(found.lengths[i])]
            greedy_norm = float(teacher_forced(ensemble, src[i], tokens).sum()) / float(
                gnmt_length_penalty(torch.tensor(tokens.shape[0]), alpha))
            assert float(result.normalized_scores[i]) >= greedy_norm - 1e-5


def test_members_must_share_a_vocabulary(device: torch.device) -> None:
    """Another output vocabulary, another pad id or a decoder-only member is refused; the
    ensemble's context is its shortest member's."""
    model = model_(seed=0, device=device)
    with pytest.raises(ValueError, match="member 1 predicts 99 target tokens but member 2 120"):
        Ensemble([model, model_(seed=1, vocab_size=120, device=device)])
    with pytest.raises(ValueError, match="pads with id 0 but member 2 with 5"):
        Ensemble([model, model_(seed=1, pad_id=5, device=device)])
    with pytest.raises(ValueError, match="an ensemble is of encoder-decoders"):
        Ensemble([model, DecoderOnly(get_preset("gpt-tiny")).to(device)])
    assert Ensemble([model, model_(seed=1, max_seq_len=20, device=device)]).config.max_seq_len == 20
