"""Beam search, encoder-decoder sampling and the KV cache's row reordering.

The proofs: beam 1 is greedy decoding; a batch decodes like each source alone (its padding and
neighbours do not matter); with a beam wide enough to hold every prefix, beam search returns
exactly the best hypotheses of an exhaustive search (alpha 0 and alpha != 0, so the stopping rule's
bound is tested too); it equals a plain Python search without KV cache that follows the same
rules (its stopping bound found by trying every future length); every returned score equals the
teacher-forced, cache-free log-probability of its tokens; a reordered cache decodes like a fresh
one.

Models: the "tiny" encoder-decoder (vocab 99, d_model 48, 6 heads, d_ff 37) with seeded weights,
an untied output projection scaled up so that distributions are peaked (random tied models
mostly repeat their input token), and eos ids the greedy outputs actually produce.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from random_weights import randomize_, right_pad
from torch.testing import assert_close

from aiayn.generate import (
    SamplingConfig,
    beam_search_encoder_decoder,
    gnmt_length_penalty,
    greedy_encoder_decoder,
    max_target_lengths,
    sample_encoder_decoder,
)
from aiayn.models import EncoderDecoder, get_preset
from aiayn.nn.kv_cache import KVCache

VOCAB, PAD, BOS = 99, 0, 1
EOS_IDS = [40, 77, 69, 96]  # tokens the t5 model's greedy outputs emit at various steps


def model_(positional: str = "t5", n_kv_heads: int | None = None, *, seed: int = 0,
           eos_boost: tuple[int, float] | None = None, device: torch.device, **overrides) -> EncoderDecoder:
    """``eos_boost=(eos, x)`` adds x to eos's output bias: hypotheses then finish early and often,
    so that the stopping rule decides when a search ends. Built and seeded on the CPU (the same
    weights on every device), then moved to ``device``."""
    torch.manual_seed(seed)
    config = get_preset("tiny", positional=positional, n_kv_heads=n_kv_heads, tie_output=False,
                        lm_head_bias=eos_boost is not None, **overrides)
    model = randomize_(EncoderDecoder(config), seed).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # peaked distributions: eos ranks and pruning both matter
        if eos_boost is not None:
            model.lm_head.bias[eos_boost[0]] += eos_boost[1]
    return model.to(device)


def sources(lengths: tuple[int, ...] = (9, 5, 2, 7), seed: int = 1, *, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return right_pad([torch.randint(3, VOCAB, (n,), generator=g).to(device) for n in lengths])


def teacher_forced(model: EncoderDecoder, src: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs (n,) of target ``tokens`` (n,) given one source row (s,), without any cache."""
    src = src[None, : int((src != PAD).sum())]
    tgt = torch.cat([torch.tensor([BOS], device=tokens.device), tokens[:-1]])[None]
    with torch.no_grad():  # generated tokens are real even if one equals pad_id
        logits = model(src, tgt, tgt_valid=torch.ones_like(tgt, dtype=torch.bool)).logits[0]
    return torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]


# ---- KVCache.reorder ------------------------------------------------------------------------
def test_kv_cache_reorder_selects_rows_of_every_buffer(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:  # drawn on the CPU: the same numbers on every device
        return torch.randn(*shape, generator=g).to(device)

    cache = KVCache(n_layers=2, batch_size=3, n_kv_heads=2, head_dim=5, max_len=7, cross_attention=True,
                    device=device)
    valid = (torch.rand(3, 4, generator=g) > 0.3).to(device)
    slots = cache.reserve(valid, torch.arange(4, device=device).expand(3, 4) * 10 + torch.arange(3, device=device)[:, None])
    for layer in cache.layers:
        layer.write(randn(3, 2, 4, 5), randn(3, 2, 4, 5), slots)
    cache.cross = [(randn(3, 2, 6, 5), randn(3, 2, 6, 5)) for _ in cache.layers]
    before = ([(la.k.clone(), la.v.clone()) for la in cache.layers],
              [(k.clone(), v.clone()) for k, v in cache.cross], cache.valid.clone(), cache.positions.clone())
    idx = torch.tensor([2, 0, 0, 1, 2], device=device)  # reorder, repeat and grow the batch
    cache.reorder(idx)
    assert cache.batch_size == 5 and cache.length == 4
    for layer, (k, v) in zip(cache.layers, before[0], strict=True):
        assert layer.k.shape == (5, 2, 7, 5)
        assert torch.equal(layer.k[:, :, :4], k[idx, :, :4]) and torch.equal(layer.v[:, :, :4], v[idx, :, :4])
    for (cross_k, cross_v), (k, v) in zip(cache.cross, before[1], strict=True):
        assert torch.equal(cross_k, k[idx]) and torch.equal(cross_v, v[idx])
    assert torch.equal(cache.valid, before[2][idx]) and torch.equal(cache.positions, before[3][idx])
    # cross=False leaves the cross-attention keys/values alone; shrinking works too.
    cache.reorder(torch.tensor([4, 3], device=device), cross=False)
    assert cache.batch_size == 2 and cache.cross[0][0].shape[0] == 5
    assert torch.equal(cache.valid, before[2][[2, 1]])
    # The cache keeps working at its new batch size.
    slots = cache.reserve(torch.ones(2, 1, dtype=torch.bool, device=device),
                          torch.zeros(2, 1, dtype=torch.long, device=device))
    cache.layers[0].write(torch.ones(2, 2, 1, 5, device=device), torch.ones(2, 2, 1, 5, device=device), slots)
    with pytest.raises(ValueError, match="out of range"):
        cache.reorder(torch.tensor([2], device=device))


def test_kv_cache_repeat_interleave(device: torch.device) -> None:
    cache = KVCache(n_layers=1, batch_size=2, n_kv_heads=1, head_dim=3, max_len=4, device=device)
    cache.reserve(torch.tensor([[True], [False]], device=device), torch.tensor([[5], [6]], device=device))
    cache.repeat_interleave(3)
    assert cache.batch_size == 6
    assert cache.positions[:, 0].tolist() == [5, 5, 5, 6, 6, 6]


@pytest.mark.parametrize("positional", ["sinusoidal", "rope", "t5"])
def test_reordered_cache_decodes_like_a_fresh_one(positional: str, device: torch.device) -> None:
    """Decode 4 target tokens, reorder the rows, decode 2 more: equal to full recomputation."""
    model = model_(positional, n_kv_heads=2, device=device)
    src = sources(device=device)
    tgt = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(5)).to(device)
    tgt[:, 0] = BOS
    idx = torch.tensor([3, 3, 0, 2, 1, 0], device=device)
    with torch.no_grad():
        encoded = model.encode(src)
        cache = model.new_cache(4, 6)
        model.decode(tgt[:, :4], encoded, cache=cache)
        cache.reorder(idx)
        reordered = type(encoded)(memory=encoded.memory[idx], valid=encoded.valid[idx])
        step = model.decode(tgt[idx, 4:6], reordered, cache=cache).logits
        full = model(src[idx], tgt[idx]).logits[:, 4:6]
    assert_close(step, full)


# ---- beam search ----------------------------------------------------------------------------
@pytest.mark.parametrize("eos", EOS_IDS)
def test_beam_size_1_is_greedy(eos: int, device: torch.device) -> None:
    model, src = model_(device=device), sources(device=device)
    limits = max_target_lengths(src != PAD, max_len_a=1.0, max_len_b=3)
    greedy = greedy_encoder_decoder(model, src, bos_id=BOS, eos_id=eos, max_new_tokens=limits)
    for alpha, early in ((0.0, False), (0.6, True), (1.0, True)):
        beam = beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=eos, beam_size=1,
                                           max_len_a=1.0, max_len_b=3, length_penalty=alpha,
                                           early_stopping=early)
        assert torch.equal(beam.lengths, greedy.lengths)
        for i, n in enumerate(greedy.lengths.tolist()):
            assert PAD not in greedy.tokens[i, :n].tolist()  # beam search never proposes pad
            assert torch.equal(beam.tokens[i, :n], greedy.tokens[i, :n])
        after = torch.arange(beam.tokens.shape[1], device=device)[None] >= beam.lengths[:, None]
        assert bool((beam.tokens[after] == PAD).all())


@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("eos", EOS_IDS[:2])
def test_batch_equals_each_source_alone(eos: int, alpha: float, device: torch.device) -> None:
    """Padding and neighbours do not change a source's result (tokens, scores, n-best)."""
    model, src = model_(device=device), sources(device=device)
    kwargs = dict(bos_id=BOS, eos_id=eos, beam_size=4, max_len_a=1.0, max_len_b=4,
                  length_penalty=alpha, n_best=3)
    batch = beam_search_encoder_decoder(model, src, **kwargs)
    for i, row in enumerate(src):
        alone = beam_search_encoder_decoder(model, row[row != PAD][None], **kwargs)
        n = int(alone.lengths[0])
        assert int(batch.lengths[i]) == n
        assert torch.equal(batch.tokens[i, :n], alone.tokens[0, :n])
        assert_close(batch.scores[i], alone.scores[0])
        assert_close(batch.normalized_scores[i], alone.normalized_scores[0])
        assert len(batch.nbest[i]) == len(alone.nbest[0]) == 3
        for h_batch, h_alone in zip(batch.nbest[i], alone.nbest[0], strict=True):
            assert torch.equal(h_batch.tokens, h_alone.tokens)
            assert_close(h_batch.token_scores, h_alone.token_scores)


def test_padding_content_and_width_do_not_matter(device: torch.device) -> None:
    """Junk ids under src_valid=False and extra padding columns leave every result unchanged."""
    model, src = model_("rope", device=device), sources(device=device)
    valid = src != PAD
    junk = torch.where(valid, src, torch.randint(3, VOCAB, src.shape, generator=torch.Generator().manual_seed(9)).to(device))
    wide = torch.cat([src, torch.zeros(src.shape[0], 5, dtype=torch.long, device=device)], dim=1)
    kwargs = dict(bos_id=BOS, eos_id=77, beam_size=3, max_len_b=4, n_best=2)
    ref = beam_search_encoder_decoder(model, src, **kwargs)
    for other in (beam_search_encoder_decoder(model, junk, src_valid=valid, **kwargs),
                  beam_search_encoder_decoder(model, wide, **kwargs)):
        assert torch.equal(other.tokens, ref.tokens) and torch.equal(other.lengths, ref.lengths)
        assert_close(other.scores, ref.scores)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope", "t5"])
@pytest.mark.parametrize("n_kv_heads", [6, 2])
def test_cached_scores_equal_teacher_forced_recomputation(positional: str, n_kv_heads: int, device: torch.device) -> None:
    """Cross-attention k/v computed once per source, expanded to beams and reordered every step
    give the same per-token log-probs as the cache-free model on the returned hypotheses."""
    model, src = model_(positional, n_kv_heads, device=device), sources(device=device)
    alpha = 0.6
    out = beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=69, beam_size=4, max_len_b=4,
                                      length_penalty=alpha, n_best=4)
    for i in range(src.shape[0]):
        assert len(out.nbest[i]) == 4
        norms = [h.normalized_score for h in out.nbest[i]]
        assert norms == sorted(norms, reverse=True)
        for h in out.nbest[i]:
            assert_close(h.token_scores, teacher_forced(model, src[i], h.tokens))
            assert_close(torch.tensor(h.score), h.token_scores.sum().cpu())
            lp = gnmt_length_penalty(torch.tensor(len(h.tokens)), alpha)
            assert_close(torch.tensor(h.normalized_score), torch.tensor(h.score) / lp)
            assert 69 not in h.tokens[:-1].tolist() and PAD not in h.tokens.tolist()
        assert torch.equal(out.tokens[i, : out.lengths[i]], out.nbest[i][0].tokens)


def reference_beam_search(model: EncoderDecoder, src: torch.Tensor, *, eos: int, k: int, limit: int,
                          alpha: float, min_len: int = 0, early_stopping: bool = False) -> list:
    """The same search written plainly for one source row: Python lists, no KV cache (every step
    recomputes the decoder on each beam's whole prefix), the stopping bound found by trying every
    future length. Returns the finished [(normalized score, score, tokens)], best first."""
    src = src[None, : int((src != PAD).sum())]

    def lp(n: int) -> float:
        return ((5 + n) / 6) ** alpha

    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[float, float, list[int]]] = []
    for t in range(1, limit + 1):
        tgt = torch.tensor([[BOS, *toks] for toks, _ in beams], device=src.device)
        with torch.no_grad():
            logits = model(src.expand(len(beams), -1), tgt, tgt_valid=torch.ones_like(tgt, dtype=torch.bool)).logits
        lprobs = torch.log_softmax(logits[:, -1].float(), -1)
        lprobs[:, PAD] = float("-inf")
        if t - 1 < min_len:
            lprobs[:, eos] = float("-inf")
        cands = [(float(beams[j][1] + lprobs[j, tok]), j, tok)
                 for j in range(len(beams)) for tok in range(lprobs.shape[1])]
        cands.sort(key=lambda c: -c[0])
        top = [c for c in cands[: 2 * k] if c[0] > float("-inf")]
        for score, j, tok in top[:k]:
            if tok == eos:
                finished.append((score / lp(t), score, beams[j][0] + [eos]))
        beams = [(beams[j][0] + [tok], score) for score, j, tok in top if tok != eos][:k]
        if t == limit:
            finished += [(score / lp(t), score, toks) for toks, score in beams]
        finished = sorted(finished, key=lambda f: -f[0])[:k]
        if t == limit or not beams:
            break
        if len(finished) == k:
            bound = max(beams[0][1] / lp(n) for n in range(t + 1, limit + 1))
            if early_stopping or finished[-1][0] >= bound:
                break
    return finished


@pytest.mark.parametrize(("seed", "eos", "k", "alpha", "early", "boost"), [
    (0, 40, 4, 0.6, False, 0.0), (0, 77, 3, 0.0, False, 0.0),
    (1, 40, 2, 0.0, False, 0.0),  # the beam prunes the greedy path of source 3
    (1, 69, 4, 1.0, False, 0.0), (1, 96, 3, 0.6, True, 0.0), (0, 69, 5, -0.4, False, 0.0),
    (2, 77, 4, 0.6, False, 0.0),  # with min_len 1
    # eos made likely: searches end by the stopping rule, which here differs from early_stopping
    (1, 69, 3, 0.6, False, 2.0), (1, 69, 3, 0.6, True, 2.0), (0, 69, 3, 1.0, False, 2.5),
    (0, 40, 3, 2.0, False, 1.0), (0, 69, 3, 0.0, False, 2.0), (0, 40, 3, -0.5, False, 1.0),
])
def test_equals_plain_reference_search(seed: int, eos: int, k: int, alpha: float, early: bool,
                                       boost: float, device: torch.device) -> None:
    model = model_(seed=seed, eos_boost=(eos, boost) if boost else None, device=device)
    src, max_len_b, min_len = sources(seed=seed + 1, device=device), 6 if boost else 3, 1 if seed == 2 else 0
    limits = max_target_lengths(src != PAD, max_len_a=1.0, max_len_b=max_len_b)
    out = beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=eos, beam_size=k, max_len_a=1.0,
                                      max_len_b=max_len_b, length_penalty=alpha, n_best=k,
                                      early_stopping=early, min_len=min_len)
    for i in range(src.shape[0]):
        ref = reference_beam_search(model, src[i], eos=eos, k=k, limit=int(limits[i]), alpha=alpha,
                                    early_stopping=early, min_len=min_len)
        assert [h.tokens.tolist() for h in out.nbest[i]] == [toks for _, _, toks in ref]
        assert_close(torch.tensor([h.score for h in out.nbest[i]]), torch.tensor([s for _, s, _ in ref]))


def greedy_normalized(model: EncoderDecoder, src: torch.Tensor, eos: int, alpha: float,
                      max_len_b: int = 3) -> list[float]:
    """Each source's greedy hypothesis, scored cache-free: sum log-prob / GNMT penalty."""
    limits = max_target_lengths(src != PAD, max_len_a=1.0, max_len_b=max_len_b)
    greedy = greedy_encoder_decoder(model, src, bos_id=BOS, eos_id=eos, max_new_tokens=limits)
    out = []
    for i in range(src.shape[0]):
        n = int(greedy.lengths[i])
        score = teacher_forced(model, src[i], greedy.tokens[i, :n]).sum()
        out.append(float(score / gnmt_length_penalty(torch.tensor(n), alpha)))
    return out


def test_plain_beam_search_can_score_below_greedy(device: torch.device) -> None:
    """Why keep_greedy exists: with beam 2 (seed 1, eos 40, alpha 0) the beam prunes the greedy
    path of source 3 and ends with -17.68 against greedy's -17.03."""
    model, src = model_(seed=1, device=device), sources(seed=2, device=device)
    greedy = greedy_normalized(model, src, 40, 0.0)
    plain = beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=40, beam_size=2, max_len_a=1.0,
                                        max_len_b=3, length_penalty=0.0)
    assert float(plain.normalized_scores[3]) < greedy[3] - 0.5


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("eos", EOS_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_never_scores_below_greedy(eos: int, seed: int, alpha: float, device: torch.device) -> None:
    """With keep_greedy (what the Translator uses) the best hypothesis's normalized score is never
    below greedy's, for every beam size; the n-best stay sorted, unique and correctly scored."""
    model, src = model_(seed=seed, device=device), sources(seed=seed + 1, device=device)
    greedy = greedy_normalized(model, src, eos, alpha)
    for beam_size in (2, 3, 4, 6):
        beam = beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=eos, beam_size=beam_size,
                                           max_len_a=1.0, max_len_b=3, length_penalty=alpha,
                                           n_best=beam_size, keep_greedy=True)
        for i in range(src.shape[0]):
            assert float(beam.normalized_scores[i]) >= greedy[i] - 1e-5, (i, beam_size)
            nbest = beam.nbest[i]
            norms = [h.normalized_score for h in nbest]
            assert norms == sorted(norms, reverse=True)
            assert len({tuple(h.tokens.tolist()) for h in nbest}) == len(nbest)
            for h in nbest:
                assert_close(torch.tensor(h.score), teacher_forced(model, src[i], h.tokens).sum().cpu())
            assert torch.equal(beam.tokens[i, : beam.lengths[i]], nbest[0].tokens)


@pytest.mark.parametrize("alpha", [0.0, 0.6, -0.5])
def test_wide_beam_equals_exhaustive_search(alpha: float, device: torch.device) -> None:
    """Vocab 6 (pad 0, bos 1, eos 2), at most 3 tokens: 1 + 4 + 16 hypotheses end in eos and 64
    stop at the limit. A beam of 80 keeps every prefix, so its 80-best must be the exhaustive
    search's 80 best of 85, in order; the stopping rule's bound must not cut any of them off."""
    eos, k = 2, 80
    model = model_("t5", vocab_size=6, device=device)
    src = torch.tensor([[3, 4, 5, 3, 4], [5, 5, 3, 0, 0]], device=device)
    out = beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=eos, beam_size=k, max_len_a=0.0,
                                      max_len_b=3, length_penalty=alpha, n_best=k)
    words = [1, 3, 4, 5]  # every id but pad and eos
    hyps = ([[eos]] + [[a, eos] for a in words] + [[a, b, eos] for a, b in itertools.product(words, words)]
            + [list(p) for p in itertools.product(words, words, words)])
    for i in range(src.shape[0]):
        scored = []
        for h in hyps:
            tokens = torch.tensor(h, device=device)
            score = teacher_forced(model, src[i], tokens).sum()
            scored.append((float(score / gnmt_length_penalty(torch.tensor(len(h)), alpha)), h))
        scored.sort(key=lambda x: -x[0])
        assert len(out.nbest[i]) == k
        for (norm, h), got in zip(scored[:k], out.nbest[i], strict=True):
            assert got.tokens.tolist() == h
            assert_close(torch.tensor(got.normalized_score), torch.tensor(norm))


def test_min_len_and_no_nan_on_an_empty_source(device: torch.device) -> None:
    model = model_(device=device)
    src = sources((6, 3), device=device)
    valid = src != PAD
    valid[1] = False  # a source with no real token: a zero-length source, not a NaN
    out = beam_search_encoder_decoder(model, src, src_valid=valid, bos_id=BOS, eos_id=77, beam_size=3,
                                      max_len_a=0.0, max_len_b=6, min_len=2, n_best=3)
    assert bool(torch.isfinite(out.scores).all()) and bool(torch.isfinite(out.normalized_scores).all())
    for hyps in out.nbest:
        for h in hyps:
            assert bool(torch.isfinite(h.token_scores).all())
            if h.tokens[-1] == 77:
                assert len(h.tokens) >= 3  # at least min_len tokens before eos
    assert out.token_lists(eos_id=77)[0] == [t for t in out.tokens[0, : out.lengths[0]].tolist() if t != 77]


def test_encoder_and_cross_attention_run_once_per_source(device: torch.device) -> None:
    model, src = model_(n_kv_heads=2, device=device), sources(device=device)
    batches: list[int] = []
    handles = [block.cross_attn.kv_proj.register_forward_hook(lambda _m, inp, _o: batches.append(inp[0].shape[0]))
               for block in model.decoder.blocks]
    handles.append(model.encoder.register_forward_hook(lambda _m, inp, _o: batches.append(-inp[0].shape[0])))
    try:
        beam_search_encoder_decoder(model, src, bos_id=BOS, eos_id=69, beam_size=5, max_len_b=6)
    finally:
        for h in handles:
            h.remove()
    assert sorted(batches) == [-4] + [4] * len(model.decoder.blocks)  # batch b, never b * beam


def test_bad_arguments(device: torch.device) -> None:
    with pytest.raises(ValueError, match="n_best"):
        beam_search_encoder_decoder(model_(device=device), sources(device=device), bos_id=BOS, eos_id=2, beam_size=2, n_best=3)


# ---- greedy limits and sampling -------------------------------------------------------------
def test_greedy_per_source_limits(device: torch.device) -> None:
    model, src = model_(device=device), sources(device=device)
    free = greedy_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=8)
    limits = torch.tensor([8, 3, 1, 5], device=device)
    limited = greedy_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=limits)
    assert torch.equal(limited.lengths, limits)
    for i, n in enumerate(limits.tolist()):
        assert torch.equal(limited.tokens[i, :n], free.tokens[i, :n])
        assert bool((limited.tokens[i, n:] == PAD).all())


def test_sampling_encoder_decoder(device: torch.device) -> None:
    model, src = model_(device=device), sources(device=device)
    limits = torch.tensor([6, 2, 4, 6], device=device)
    greedy = greedy_encoder_decoder(model, src, bos_id=BOS, eos_id=40, max_new_tokens=limits)
    for cfg in (SamplingConfig(temperature=0), SamplingConfig(top_k=1, seed=3)):
        out = sample_encoder_decoder(model, src, bos_id=BOS, eos_id=40, max_new_tokens=limits, sampling=cfg)
        assert torch.equal(out, greedy.tokens)
    cfg = SamplingConfig(temperature=1.3, top_k=20, top_p=0.9, seed=7)
    a = sample_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=limits, sampling=cfg)
    b = sample_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=limits, sampling=cfg)
    assert torch.equal(a, b) and a.shape == (4, 6)
    assert not torch.equal(a, greedy_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=limits).tokens)
    for i, n in enumerate(limits.tolist()):
        assert bool((a[i, n:] == PAD).all())


@pytest.mark.parametrize(("seed", "eos", "k", "alpha", "boost"), [
    (0, 40, 4, 0.6, 0.0), (1, 40, 2, 0.0, 0.0), (1, 69, 3, 0.6, 2.0), (0, 69, 5, 1.0, 2.5),
])
def test_traced_search_equals_untraced_and_its_trace_rebuilds_the_nbest(seed: int, eos: int, k: int,
                                                                        alpha: float, boost: float, device: torch.device) -> None:
    """``trace=`` (what aiayn explore draws the beam tree from) changes nothing: the same tokens,
    scores and n-best lists; and following the trace's parent links from step to step rebuilds
    every finished hypothesis, so each returned hypothesis is one of them with the same score."""
    model = model_(seed=seed, eos_boost=(eos, boost) if boost else None, device=device)
    src = sources(seed=seed + 1, device=device)
    args = dict(bos_id=BOS, eos_id=eos, beam_size=k, max_len_a=1.0, max_len_b=6 if boost else 3,
                length_penalty=alpha, n_best=k)
    steps = []
    traced = beam_search_encoder_decoder(model, src, trace=steps.append, **args)
    plain = beam_search_encoder_decoder(model, src, **args)
    assert torch.equal(traced.tokens, plain.tokens) and torch.equal(traced.lengths, plain.lengths)
    assert torch.equal(traced.scores, plain.scores)
    assert [[(h.tokens.tolist(), h.score) for h in row] for row in traced.nbest] == \
           [[(h.tokens.tolist(), h.score) for h in row] for row in plain.nbest]

    beams = {i: [([], 0.0)] for i in range(src.shape[0])}  # source -> open (tokens, score) by slot
    finished: dict[int, list[tuple[list[int], float]]] = {i: [] for i in beams}
    for step in steps:
        assert step.t == len(beams[int(step.sources[0])][0][0]) + 1
        for row, source in enumerate(step.sources.tolist()):
            history = [(beams[source][int(p)][0] + [int(tok)], float(s))
                       for p, tok, s in zip(step.parent[row], step.token[row], step.score[row], strict=True)]
            finished[source] += [h for h, f in zip(history, step.finished[row].tolist(), strict=True) if f]
            slots = step.slot[row].tolist()
            beams[source] = [history[slots.index(j)] for j in range(k)]
            if step.at_limit[row]:
                finished[source] += [b for b in beams[source] if b[1] > float("-inf")]
            assert not (step.finished[row] & (step.slot[row] >= 0)).any()
    for source, row in enumerate(traced.nbest):
        for h in row:
            scores = [s for toks, s in finished[source] if toks == h.tokens.tolist()]
            assert scores and torch.tensor(scores[0]).item() == torch.tensor(h.score).item()
