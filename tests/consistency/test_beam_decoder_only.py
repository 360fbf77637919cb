"""Beam search for decoder-only models (``beam_search_decoder_only``), which shares its search loop
with the encoder-decoder one: beam 1 is greedy decoding; a left-padded batch searches like each
prompt alone; a beam wide enough to keep every prefix returns exactly the exhaustive search's best
hypotheses; every score equals a cache-free recomputation; the trace changes nothing.

Model: LLaMA-like (RoPE, GQA, RMSNorm, SwiGLU) at odd tiny sizes with seeded weights, pad id 0 made
unlikely (beam search never proposes pad; greedy decoding would be free to).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from random_weights import randomize_
from torch.testing import assert_close

from aiayn.config import ModelConfig
from aiayn.generate import beam_search_decoder_only, gnmt_length_penalty, greedy_decoder_only
from aiayn.models import build_model

PAD = 0


def model_(vocab: int = 99, seed: int = 0, *, device: torch.device):
    """Built and seeded on the CPU (the same weights on every device), then moved to ``device``."""
    torch.manual_seed(seed)
    config = ModelConfig(arch="decoder-only", vocab_size=vocab, d_model=48, n_heads=6, n_kv_heads=2, n_layers=2,
                         d_ff=37, activation="swiglu", norm="rmsnorm", norm_position="pre", positional="rope",
                         bias=False, scale_embeddings=False, tie_output=False, lm_head_bias=True, pad_id=PAD,
                         max_seq_len=32)
    model = randomize_(build_model(config), seed).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # peaked distributions: eos ranks and pruning both matter
        model.lm_head.bias[PAD] = -30.0
    return model.to(device)


def prompts(seed: int = 1, *, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 6) left-padded prompts of 6, 3 and 1 real tokens -> (tokens, valid), on ``device``."""
    tokens = torch.randint(3, 99, (3, 6), generator=torch.Generator().manual_seed(seed)).to(device)
    valid = torch.ones(3, 6, dtype=torch.bool, device=device)
    valid[1, :3] = valid[2, :5] = False
    return tokens.masked_fill(~valid, PAD), valid


def recomputed(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs (n,) of ``tokens`` (n,) after one unpadded ``prompt`` (t,), without a cache."""
    full = torch.cat([prompt, tokens])[None]
    with torch.no_grad():
        logits = model(full, valid=torch.ones_like(full, dtype=torch.bool)).logits[0, prompt.shape[0] - 1: -1]
    return torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("eos", [5, 40, 77])
def test_beam_1_is_greedy(eos: int, device: torch.device) -> None:
    model, (tokens, valid) = model_(device=device), prompts(device=device)
    greedy = greedy_decoder_only(model, tokens, prompt_valid=valid, max_new_tokens=8, eos_id=eos)
    beam = beam_search_decoder_only(model, tokens, prompt_valid=valid, eos_id=eos, max_new_tokens=8, beam_size=1)
    for i in range(3):
        ids = greedy.tokens[i].tolist()
        n = ids.index(eos) + 1 if eos in ids else len(ids)
        assert beam.nbest[i][0].tokens.tolist() == ids[:n]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_batch_equals_each_prompt_alone_and_scores_equal_recomputation(alpha: float, device: torch.device) -> None:
    model, (tokens, valid) = model_(seed=2, device=device), prompts(seed=3, device=device)
    batch = beam_search_decoder_only(model, tokens, prompt_valid=valid, eos_id=40, max_new_tokens=6, beam_size=4,
                                     length_penalty=alpha, n_best=4)
    for i in range(3):
        alone = beam_search_decoder_only(model, tokens[i:i + 1, valid[i]], eos_id=40, max_new_tokens=6,
                                         beam_size=4, length_penalty=alpha, n_best=4)
        assert [h.tokens.tolist() for h in batch.nbest[i]] == [h.tokens.tolist() for h in alone.nbest[0]]
        assert_close(torch.tensor([h.score for h in batch.nbest[i]]), torch.tensor([h.score for h in alone.nbest[0]]))
        for h in batch.nbest[i]:
            assert_close(h.token_scores, recomputed(model, tokens[i, valid[i]], h.tokens))
            lp = gnmt_length_penalty(torch.tensor(len(h.tokens)), alpha)
            assert_close(torch.tensor(h.normalized_score), torch.tensor(h.score) / lp)
            assert PAD not in h.tokens.tolist()


@pytest.mark.parametrize("alpha", [0.0, 0.8])
def test_wide_beam_equals_exhaustive_search(alpha: float, device: torch.device) -> None:
    """Vocab 6 (pad 0, eos 2), at most 3 new tokens: 1 + 4 + 16 hypotheses end in eos and 64 stop at
    the limit; a beam of 80 keeps every prefix, so its 80-best are the exhaustive search's, in order."""
    eos, k = 2, 80
    model = model_(vocab=6, device=device)
    prompt = torch.tensor([[3, 4, 5, 1]], device=device)
    out = beam_search_decoder_only(model, prompt, eos_id=eos, max_new_tokens=3, beam_size=k, length_penalty=alpha,
                                   n_best=k)
    words = [1, 3, 4, 5]  # every id but pad and eos
    hyps = ([[eos]] + [[a, eos] for a in words] + [[a, b, eos] for a, b in itertools.product(words, words)]
            + [list(p) for p in itertools.product(words, words, words)])
    scored = sorted(((float(recomputed(model, prompt[0], torch.tensor(h, device=device)).sum()
                            / gnmt_length_penalty(torch.tensor(len(h)), alpha)), h) for h in hyps),
                    key=lambda x: -x[0])
    assert len(out.nbest[0]) == k
    for (norm, h), got in zip(scored[:k], out.nbest[0], strict=True):
        assert got.tokens.tolist() == h
        assert_close(torch.tensor(got.normalized_score), torch.tensor(norm))


def test_trace_changes_nothing_and_bad_arguments(device: torch.device) -> None:
    model, (tokens, valid) = model_(seed=1, device=device), prompts(seed=4, device=device)
    steps = []
    args = dict(prompt_valid=valid, eos_id=77, max_new_tokens=5, beam_size=3, n_best=3)
    traced = beam_search_decoder_only(model, tokens, trace=steps.append, **args)
    plain = beam_search_decoder_only(model, tokens, **args)
    assert [[(h.tokens.tolist(), h.score) for h in row] for row in traced.nbest] == \
           [[(h.tokens.tolist(), h.score) for h in row] for row in plain.nbest]
    assert steps and steps[0].t == 1 and steps[0].token.shape == (3, 6)
    with pytest.raises(ValueError, match="must fit the model's context of 32"):
        beam_search_decoder_only(model, tokens, eos_id=77, max_new_tokens=27)
    with pytest.raises(ValueError, match="n_best"):
        beam_search_decoder_only(model, tokens, eos_id=77, max_new_tokens=2, beam_size=2, n_best=3)


def test_without_an_end_of_text_token_every_hypothesis_runs_to_the_limit(device: torch.device) -> None:
    """A character-level model has no eos: the search ranks hypotheses of the full length, and
    beam 1 is still greedy decoding."""
    model, (tokens, valid) = model_(seed=3, device=device), prompts(seed=5, device=device)
    out = beam_search_decoder_only(model, tokens, prompt_valid=valid, eos_id=None, max_new_tokens=5, beam_size=3,
                                   n_best=3)
    assert all(len(h.tokens) == 5 for row in out.nbest for h in row) and out.lengths.tolist() == [5, 5, 5]
    greedy = greedy_decoder_only(model, tokens, prompt_valid=valid, max_new_tokens=5)
    one = beam_search_decoder_only(model, tokens, prompt_valid=valid, eos_id=None, max_new_tokens=5, beam_size=1)
    assert torch.equal(one.tokens, greedy.tokens)
