"""The decode iterators ``stream_decoder_only`` / ``stream_encoder_decoder``: the loops the greedy
and sampling functions collect.

Proofs: the iterator yields exactly the wrappers' tokens (greedy and seeded sampling, both
architectures, left-padded prompts, per-source limits); every step's logits equal a cache-free
forward over the sequence so far; it stops once every row has emitted eos and fills finished rows;
it runs the model lazily, so a caller that leaves the loop early costs no further step; importing
aiayn.generate does not import aiayn.fast.

Models: tiny random ones (vocab 99, d_model 48) from ``build_model(ModelConfig(...))`` with seeded
weights at a scale where attention is far from uniform (``random_weights.randomize_``), and an
output bias on eos so that rows finish at different steps.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from random_weights import randomize_, right_pad
from torch import nn
from torch.testing import assert_close

from aiayn.config import ModelConfig
from aiayn.generate import (
    DecodeStep,
    SamplingConfig,
    generate_decoder_only,
    greedy_decoder_only,
    greedy_encoder_decoder,
    sample_encoder_decoder,
    stream_decoder_only,
    stream_encoder_decoder,
)
from aiayn.models import build_model

VOCAB, PAD, BOS, EOS = 99, 0, 1, 3
SAMPLING = SamplingConfig(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.2, seed=5)


# Models are built and seeded on the CPU (the same weights on every device), then moved to the test's
# device; ids are drawn on the CPU and moved likewise.
def language_model(eos_boost: float = 0.0, *, device: torch.device) -> nn.Module:
    """LLaMA-like (RoPE, GQA, RMSNorm, SwiGLU) with pad_id 0; ``eos_boost`` is added to eos's output bias."""
    torch.manual_seed(0)
    config = ModelConfig(arch="decoder-only", vocab_size=VOCAB, d_model=48, n_heads=6, n_kv_heads=2, n_layers=2,
                         d_ff=37, activation="swiglu", norm="rmsnorm", norm_position="pre", positional="rope",
                         bias=False, scale_embeddings=False, tie_output=False, lm_head_bias=True, pad_id=PAD,
                         max_seq_len=64)
    model = randomize_(build_model(config), 0).eval()
    with torch.no_grad():
        model.lm_head.bias[EOS] += eos_boost
    return model.to(device)


def translation_model(eos_boost: float = 0.0, *, device: torch.device) -> nn.Module:
    """The paper's encoder-decoder at toy size, T5 relative positions, pad_id 0."""
    torch.manual_seed(0)
    config = ModelConfig(arch="encoder-decoder", vocab_size=VOCAB, d_model=48, n_heads=6, n_layers=2, d_ff=37,
                         positional="t5", tie_output=False, lm_head_bias=True, pad_id=PAD, max_seq_len=64)
    model = randomize_(build_model(config), 0).eval()
    with torch.no_grad():
        model.lm_head.bias[EOS] += eos_boost
    return model.to(device)


def ids(b: int, t: int, seed: int, *, device: torch.device) -> torch.Tensor:
    """Token ids in [4, VOCAB): never pad, bos or eos."""
    return torch.randint(4, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed)).to(device)


def left_padded_prompt(*, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 6) prompt of 6, 3 and 1 real tokens, left-padded with pad ids -> (tokens, valid)."""
    tokens = ids(3, 6, seed=1, device=device)
    valid = torch.ones(3, 6, dtype=torch.bool, device=device)
    valid[1, :3] = valid[2, :5] = False
    return tokens.masked_fill(~valid, PAD), valid


def sources(*, device: torch.device) -> torch.Tensor:
    """(4, 9) right-padded sources of 9, 5, 2 and 7 tokens."""
    return right_pad([ids(1, n, seed=10 + n, device=device)[0] for n in (9, 5, 2, 7)])


def collect(steps: list[DecodeStep]) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps -> tokens (b, n), logits (b, n, v)."""
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)


def first_eos(tokens: torch.Tensor) -> list[int | None]:
    return [int((row == EOS).nonzero()[0, 0]) if bool((row == EOS).any()) else None for row in tokens]


# ---- the iterator is the wrappers' loop ---------------------------------------------------------
@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "recomputed"])
def test_decoder_only_stream_yields_the_greedy_tokens(use_cache: bool, device: torch.device) -> None:
    model = language_model(device=device)
    prompt, valid = left_padded_prompt(device=device)
    steps = list(stream_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=10, use_cache=use_cache))
    tokens, logits = collect(steps)
    greedy = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=10, use_cache=use_cache)
    assert [s.index for s in steps] == list(range(10))
    assert torch.equal(tokens, greedy.tokens) and tokens.shape == (3, 10)
    assert torch.equal(logits, greedy.logits)
    assert torch.equal(tokens, logits.argmax(-1))  # greedy: each token is its step's argmax
    assert all(bool(s.active.all()) and not bool(s.done.any()) for s in steps)  # no eos: nobody finishes


def test_decoder_only_stream_yields_the_seeded_samples(device: torch.device) -> None:
    model = language_model(device=device)
    prompt, valid = left_padded_prompt(device=device)
    tokens, _ = collect(list(stream_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=12,
                                                 sampling=SAMPLING)))
    sampled = generate_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=12, sampling=SAMPLING)
    assert torch.equal(tokens, sampled)
    again, _ = collect(list(stream_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=12,
                                                sampling=SAMPLING)))
    assert torch.equal(again, tokens)  # the seed reproduces the draws
    greedy = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=12).tokens
    assert not torch.equal(tokens, greedy)  # it did sample
    # The steps come as they are made: a caller that stops after 4 has the first 4 of the same draws.
    steps = stream_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=12, sampling=SAMPLING)
    early = torch.stack([step.tokens for step, _ in zip(steps, range(4), strict=False)], dim=1)
    steps.close()
    assert torch.equal(early, tokens[:, :4])


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "recomputed"])
def test_encoder_decoder_stream_yields_the_greedy_tokens_and_lengths(use_cache: bool, device: torch.device) -> None:
    model = translation_model(eos_boost=2.5, device=device)
    src = sources(device=device)
    limits = torch.tensor([12, 4, 1, 7], device=device)
    steps = list(stream_encoder_decoder(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=limits,
                                        use_cache=use_cache))
    tokens, logits = collect(steps)
    greedy = greedy_encoder_decoder(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=limits, use_cache=use_cache)
    assert torch.equal(tokens, greedy.tokens)
    assert torch.equal(logits, greedy.logits)
    lengths = torch.stack([s.active for s in steps]).sum(0)
    assert torch.equal(lengths, greedy.lengths)
    # Each row stops at its eos or its limit, whichever comes first; then it holds pad.
    expected = [n if e is None else min(n, e + 1)
                for n, e in zip(limits.tolist(), first_eos(tokens), strict=True)]
    assert lengths.tolist() == expected and expected != limits.tolist()  # eos cut some rows short
    for row, n in enumerate(expected):
        assert bool((tokens[row, n:] == PAD).all())


def test_encoder_decoder_stream_yields_the_seeded_samples(device: torch.device) -> None:
    model = translation_model(device=device)
    src = sources(device=device)
    limits = torch.tensor([8, 3, 5, 8], device=device)
    tokens, _ = collect(list(stream_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=limits,
                                                    sampling=SAMPLING)))
    sampled = sample_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=limits, sampling=SAMPLING)
    assert torch.equal(tokens, sampled) and tokens.shape == (4, 8)
    greedy = greedy_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=limits).tokens
    assert not torch.equal(tokens, greedy)
    greedy_sampling, _ = collect(list(stream_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=limits,
                                                             sampling=SamplingConfig(temperature=0))))
    assert torch.equal(greedy_sampling, greedy)  # temperature 0 is greedy


# ---- every step's logits are the model's over the sequence so far --------------------------------
@pytest.mark.parametrize("sampling", [None, SAMPLING], ids=["greedy", "sampled"])
def test_decoder_only_step_logits_equal_a_full_forward(sampling: SamplingConfig | None, device: torch.device) -> None:
    model = language_model(device=device)
    prompt, valid = left_padded_prompt(device=device)
    t = prompt.shape[1]
    tokens, logits = collect(list(stream_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=10,
                                                      sampling=sampling)))
    generated_valid = torch.ones_like(tokens, dtype=torch.bool)
    with torch.no_grad():  # one forward over prompt + generated tokens, no cache
        full = model(torch.cat([prompt, tokens], 1), valid=torch.cat([valid, generated_valid], 1)).logits
    assert_close(logits, full[:, t - 1 : t - 1 + tokens.shape[1]])


@pytest.mark.parametrize("sampling", [None, SAMPLING], ids=["greedy", "sampled"])
def test_encoder_decoder_step_logits_equal_teacher_forcing(sampling: SamplingConfig | None, device: torch.device) -> None:
    model = translation_model(device=device)
    src = sources(device=device)
    tokens, logits = collect(list(stream_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=10,
                                                         sampling=sampling)))
    target = torch.cat([torch.full((4, 1), BOS, device=device), tokens], 1)  # (b, 1 + n): bos and the generated tokens
    with torch.no_grad():
        full = model(src, target, tgt_valid=torch.ones_like(target, dtype=torch.bool)).logits
    assert_close(logits, full[:, :-1])


# ---- eos ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["decoder-only", "encoder-decoder"])
def test_stream_stops_once_every_row_has_emitted_eos(arch: str, device: torch.device) -> None:
    if arch == "decoder-only":
        steps = list(stream_decoder_only(language_model(eos_boost=2.5, device=device), ids(4, 5, seed=1, device=device),
                                         max_new_tokens=30, eos_id=EOS))
    else:
        steps = list(stream_encoder_decoder(translation_model(eos_boost=2.5, device=device), sources(device=device),
                                            bos_id=BOS, max_new_tokens=30, eos_id=EOS))
    tokens, _ = collect(steps)
    stops = first_eos(tokens)
    assert None not in stops and len(set(stops)) > 1  # every row ends, at different steps
    assert len(steps) == max(stops) + 1 < 30  # the loop ends at the last row's eos
    for row, stop in enumerate(stops):
        assert bool((tokens[row, stop + 1 :] == PAD).all())  # finished rows hold pad_id
        assert [bool(s.done[row]) for s in steps] == [i >= stop for i in range(len(steps))]
        assert [bool(s.active[row]) for s in steps] == [i <= stop for i in range(len(steps))]


@pytest.mark.parametrize("arch", ["decoder-only", "encoder-decoder"])
@pytest.mark.parametrize("sampling", [None, SAMPLING], ids=["greedy", "sampled"])
def test_the_lagged_done_check_yields_the_same_steps(arch: str, sampling: SamplingConfig | None,
                                                    device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU "is every row done?" is read one step late (``DoneCheck``: no host-device sync per
    step): the loop yields the same steps, tokens, logits and flags, and computes one step more,
    which it drops. Here the lag is forced on the test's device (on CUDA it is the default)."""
    from aiayn.generate import results as results_module

    model = (language_model(eos_boost=2.5, device=device) if arch == "decoder-only"
             else translation_model(eos_boost=2.5, device=device))
    calls = count_output_calls(model)

    def run(lagged: bool) -> list[DecodeStep]:
        monkeypatch.setattr(results_module, "LAGGED_DONE_DEVICES", (device.type,) if lagged else ())
        calls[0] = 0
        if arch == "decoder-only":
            return list(stream_decoder_only(model, ids(4, 5, seed=1, device=device), max_new_tokens=30, eos_id=EOS,
                                            sampling=sampling))
        return list(stream_encoder_decoder(model, sources(device=device), bos_id=BOS, max_new_tokens=30,
                                           eos_id=EOS, sampling=sampling))

    at_once = run(lagged=False)
    assert calls[0] == len(at_once) < 30  # every row ended early
    lagged = run(lagged=True)
    assert calls[0] == len(at_once) + 1  # one step past the end, dropped
    assert len(lagged) == len(at_once)
    for a, b in zip(at_once, lagged, strict=True):
        assert a.index == b.index and torch.equal(a.tokens, b.tokens) and torch.equal(a.done, b.done)
        assert torch.equal(a.active, b.active) and torch.equal(a.logits, b.logits)
    assert bool(lagged[-1].done.all()) and not bool(lagged[-2].done.all())


@pytest.mark.parametrize("arch", ["decoder-only", "encoder-decoder"])
def test_on_cuda_the_steps_after_the_first_read_nothing_back(arch: str, device: torch.device) -> None:
    """Under CUDA's sync debug mode "error", every step after the first (the prompt's, whose
    checks may read) of a greedy loop with eos runs without a host-device sync: the done flag
    travels to the host without waiting (``DoneCheck``)."""
    if device.type != "cuda":
        pytest.skip("a host-device sync exists on CUDA only")
    if arch == "decoder-only":
        loop = stream_decoder_only(language_model(eos_boost=2.5, device=device), ids(4, 5, seed=1, device=device),
                                   max_new_tokens=30, eos_id=EOS)
    else:
        loop = stream_encoder_decoder(translation_model(eos_boost=2.5, device=device), sources(device=device),
                                      bos_id=BOS, max_new_tokens=30, eos_id=EOS)
    steps = [next(loop)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps.extend(loop)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 1 < len(steps) < 30 and bool(steps[-1].done.all())


def test_without_eos_the_loop_reads_no_done_flag(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """No eos and no grammar: no row can finish early, so the loop runs to max_new_tokens without
    a done check (on a GPU, without a read of the device between steps)."""
    from aiayn.generate import results as results_module

    def refuse(*_: object) -> None:
        raise AssertionError("a done check was made")

    monkeypatch.setattr(results_module.DoneCheck, "__init__", refuse)
    steps = list(stream_decoder_only(language_model(eos_boost=2.5, device=device), ids(2, 5, seed=1, device=device),
                                     max_new_tokens=12))
    assert len(steps) == 12


def test_fill_id_after_eos(device: torch.device) -> None:
    """generate_decoder_only repeats eos after eos; the stream's fill_id chooses."""
    model, prompt = language_model(eos_boost=2.5, device=device), ids(4, 5, seed=1, device=device)
    sampled = generate_decoder_only(model, prompt, max_new_tokens=30, eos_id=EOS,
                                    sampling=SamplingConfig(temperature=0))
    streamed, _ = collect(list(stream_decoder_only(model, prompt, max_new_tokens=30, eos_id=EOS, fill_id=EOS)))
    assert torch.equal(sampled, streamed)
    for row, stop in enumerate(first_eos(streamed)):
        assert stop is not None and bool((streamed[row, stop:] == EOS).all())


# ---- leaving early ------------------------------------------------------------------------------
def count_output_calls(model: nn.Module) -> list[int]:
    calls = [0]
    model.lm_head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("arch", ["decoder-only", "encoder-decoder"])
def test_leaving_the_loop_early_runs_no_further_step(arch: str, device: torch.device) -> None:
    model = language_model(device=device) if arch == "decoder-only" else translation_model(device=device)
    calls = count_output_calls(model)

    def stream():
        if arch == "decoder-only":
            return stream_decoder_only(model, ids(2, 5, seed=2, device=device), max_new_tokens=20, sampling=SAMPLING)
        return stream_encoder_decoder(model, sources(device=device), bos_id=BOS, max_new_tokens=20, sampling=SAMPLING)

    full, _ = collect(list(stream()))
    assert calls[0] == 20  # one model step (one output projection) per token
    calls[0] = 0
    taken = []
    for step in stream():
        taken.append(step.tokens)
        if step.index == 2:
            break
    assert calls[0] == 3 and torch.equal(torch.stack(taken, 1), full[:, :3])  # same draws, seeded
    calls[0] = 0
    steps = stream()
    first = next(steps)
    steps.close()
    assert calls[0] == 1 and torch.equal(first.tokens, full[:, 0])
    with pytest.raises(StopIteration):
        next(steps)


def test_bad_arguments_raise_on_the_call_not_at_the_first_step(device: torch.device) -> None:
    model, prompt = language_model(device=device), ids(2, 5, seed=3, device=device)
    calls = count_output_calls(model)
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        stream_decoder_only(model, prompt, max_new_tokens=60, slide=False)
    no_real = torch.ones(2, 5, dtype=torch.bool, device=device)
    no_real[1] = False
    with pytest.raises(ValueError, match="has no real token"):
        stream_decoder_only(model, prompt, prompt_valid=no_real, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_valid must be a bool tensor of the prompt's shape"):
        stream_decoder_only(model, prompt, prompt_valid=no_real.long(), max_new_tokens=2)
    with pytest.raises(ValueError, match="use_cache=True"):
        stream_decoder_only(model, prompt, max_new_tokens=2, compile=True, use_cache=False)
    assert calls[0] == 0



def test_the_collecting_wrappers_refuse_an_option_they_do_not_pass_on(device: torch.device) -> None:
    """A greedy call given ``sampling=`` raises Python's TypeError for an unexpected keyword, as a
    signature without ``**options`` would, instead of sampling."""
    model, prompt = language_model(device=device), ids(2, 5, seed=3, device=device)
    with pytest.raises(TypeError, match=r"greedy_decoder_only\(\) got an unexpected keyword argument 'sampling'"):
        greedy_decoder_only(model, prompt, max_new_tokens=2, sampling=SamplingConfig())
    with pytest.raises(TypeError, match="unexpected keyword argument 'beam_size'"):
        generate_decoder_only(model, prompt, max_new_tokens=2, beam_size=2)
    kwargs = {"sampling": SamplingConfig()}
    with pytest.raises(TypeError, match=r"greedy_encoder_decoder\(\) got an unexpected keyword argument 'sampling'"):
        greedy_encoder_decoder(translation_model(device=device), prompt, bos_id=1, max_new_tokens=2, **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'slide'"):
        sample_encoder_decoder(translation_model(device=device), prompt, bos_id=1, max_new_tokens=2, slide=True)

# ---- imports ----------------------------------------------------------------------------------------
@pytest.mark.cpu_only  # which modules an import loads: no device involved
def test_importing_generate_leaves_aiayn_fast_unimported() -> None:
    # compiled_decode_step is imported on access only: before it, nothing of aiayn.fast. One child
    # process (a fresh sys.modules) prints the aiayn.fast modules before and after that access.
    fast_modules = "print(sorted(m for m in sys.modules if m.startswith('aiayn.fast')))"
    code = f"import sys, aiayn.generate; {fast_modules}; from aiayn.generate import compiled_decode_step; {fast_modules}"
    before, after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True).stdout.strip().splitlines()
    assert before == "[]"
    assert "aiayn.fast.compiled_decode" in after


def test_each_step_hands_out_the_cache_as_it_fills(device: torch.device) -> None:
    """DecodeStep.cache (what aiayn explore shows filling): the loop's one cache, holding every token
    fed so far after each step (the prompt, then one more per step); None when recomputing."""
    model = language_model(device=device)
    prompt, valid = left_padded_prompt(device=device)
    t = prompt.shape[1]
    caches = []
    for step in stream_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=5):
        caches.append(step.cache)
        assert step.cache.length == t + step.index  # this step's token is fed at the next step
        assert torch.equal(step.cache.valid[:, :t], valid) and bool(step.cache.valid[:, t:t + step.index].all())
    assert all(c is caches[0] for c in caches) and caches[0].max_len == t + 5
    assert all(s.cache is None for s in stream_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=2,
                                                            use_cache=False))
    src = sources(device=device)
    filled = [(s.cache.length, s.cache.cross is not None)
              for s in stream_encoder_decoder(translation_model(device=device), src, bos_id=1, max_new_tokens=4)]
    assert filled == [(1, True), (2, True), (3, True), (4, True)]  # cross-attention k/v from the first step
