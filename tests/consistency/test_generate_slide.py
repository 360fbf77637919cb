"""Decoder-only generation past the model's context: the loop slides its window
(``aiayn.generate.window``) instead of stopping, so ``max_new_tokens`` is what comes back.

Proofs: greedy decoding of more tokens than the context returns exactly ``max_new_tokens``; every
token (and its logits) equals a reference written here without the loop: the plain model, no
cache, run on the window the token follows (the last L tokens, L growing by one per token and
falling back to ``keep_tokens(context)`` when it would pass the context); so does the cache-free
path. A left-padded batch gives each row the tokens it gets alone (rows slide at their own
steps); seeded sampling with the repetition penalty draws the same tokens cached and cache-free;
the compiled step equals the eager one across slides, without a new graph (``slow``);
``slide=False`` keeps the old refusal.

Models: ``gpt-tiny``/``llama-tiny`` with a 16-token context and seeded, far-from-uniform weights
(``random_weights.randomize_``), so that 40 new tokens slide several times.
"""

from __future__ import annotations

import pytest
import torch
from random_weights import randomize_
from test_kv_cache import left_pad, random_tokens
from torch.testing import assert_close

from aiayn.generate import (
    SamplingConfig,
    generate_decoder_only,
    greedy_decoder_only,
    stream_decoder_only,
)
from aiayn.generate.window import keep_tokens
from aiayn.models import DecoderOnly, get_preset

CONTEXT = 16


def model_for(positional: str, *, device: torch.device, preset: str = "gpt-tiny") -> DecoderOnly:
    """A 16-token context; seeded on the CPU (the same weights on every device), then moved."""
    torch.manual_seed(0)
    return randomize_(DecoderOnly(get_preset(preset, positional=positional, max_seq_len=CONTEXT)), 0).eval().to(device)


@torch.inference_mode()
def window_reference(model: DecoderOnly, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens of one row, each the argmax of the plain model (no cache) over the window it
    follows -> (tokens, logits (n, v))."""
    context, keep = model.config.max_seq_len, keep_tokens(model.config.max_seq_len)
    device = model.lm_head.weight.device
    seq, length, tokens, logits = list(prompt), len(prompt), [], []
    for _ in range(n):
        last = model(torch.tensor([seq[-length:]], device=device)).logits[0, -1]  # (v,)
        tokens.append(int(last.argmax()))
        logits.append(last)
        seq.append(tokens[-1])
        length = length + 1 if length < context else keep  # the next token needs a position < context
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("positional", ["learned", "rope", "alibi"])
def test_greedy_past_the_context_equals_the_window_reference(positional: str, device: torch.device) -> None:
    model = model_for(positional, device=device)
    prompt = random_tokens(1, 5, seed=3, device=device)
    steps = list(stream_decoder_only(model, prompt, max_new_tokens=40))
    assert len(steps) == 40  # 5 + 40 tokens through a 16-token context
    # the 12th new token fills the context; then the window of 12 + 4 tokens every 5 steps
    assert [s.index for s in steps if s.slid] == [12, 17, 22, 27, 32, 37]
    tokens, logits = window_reference(model, prompt[0].tolist(), 40)
    cached = greedy_decoder_only(model, prompt, max_new_tokens=40)
    assert cached.tokens.shape == (1, 40) and cached.tokens[0].tolist() == tokens
    assert_close(cached.logits[0], logits)
    uncached = greedy_decoder_only(model, prompt, max_new_tokens=40, use_cache=False)
    assert uncached.tokens[0].tolist() == tokens


def test_a_left_padded_batch_slides_each_row_as_alone(device: torch.device) -> None:
    """Rows of 9, 2 and 16 real tokens (the last fills the context at once) slide at their own
    steps; each gets its tokens alone and the reference's."""
    model = model_for("rope", device=device, preset="llama-tiny")
    rows = [random_tokens(1, n, seed=30 + n, device=device)[0] for n in (9, 2, 16)]
    prompt, valid = left_pad(rows)
    batch = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=30)
    assert batch.tokens.shape == (3, 30)
    for i, row in enumerate(rows):
        alone = greedy_decoder_only(model, row[None], max_new_tokens=30)
        assert torch.equal(batch.tokens[i], alone.tokens[0])
        assert batch.tokens[i].tolist() == window_reference(model, row.tolist(), 30)[0]


def test_seeded_sampling_slides_cached_as_uncached(device: torch.device) -> None:
    """The repetition penalty reads the window the model sees, on both paths."""
    model = model_for("learned", device=device)
    prompt = random_tokens(2, 6, seed=4, device=device)
    sampling = SamplingConfig(temperature=0.9, top_k=30, repetition_penalty=1.3, seed=5)
    cached = generate_decoder_only(model, prompt, max_new_tokens=35, sampling=sampling)
    uncached = [step.tokens for step in stream_decoder_only(model, prompt, max_new_tokens=35, sampling=sampling,
                                                            use_cache=False)]
    assert cached.shape == (2, 35) and torch.equal(cached, torch.stack(uncached, 1))
    int8 = generate_decoder_only(model, prompt, max_new_tokens=35, sampling=sampling, kv_cache="int8")
    assert int8.shape == (2, 35)  # a quantised cache slides too


def test_slide_false_refuses_as_before_and_a_prompt_must_fit(device: torch.device) -> None:
    model = model_for("learned", device=device)
    prompt = random_tokens(2, 5, seed=3, device=device)
    with pytest.raises(ValueError, match="exceeds the model's context of 16; shorten the prompt, ask for fewer"):
        greedy_decoder_only(model, prompt, max_new_tokens=12, slide=False)
    assert greedy_decoder_only(model, prompt, max_new_tokens=11, slide=False).tokens.shape == (2, 11)
    with pytest.raises(ValueError, match="prompt of 17 tokens exceeds the model's context of 16"):
        stream_decoder_only(model, random_tokens(1, 17, device=device), max_new_tokens=1)


@pytest.mark.slow  # compiles the step (seconds per layout)
@pytest.mark.parametrize("whole_buffer", [False, True])
def test_compiled_decoding_slides_as_eager_on_one_graph(whole_buffer: bool, device: torch.device,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Across slides the compiled step (the prefix layout, or the whole-buffer one a GPU uses)
    gives the eager tokens and logits; a slide clears the same cache, so no graph is added."""
    from torch._dynamo.utils import counters

    from aiayn.fast import compiled_decode

    monkeypatch.setattr(compiled_decode, "WHOLE_BUFFER_DEVICES", (device.type,) if whole_buffer else ())
    model = model_for("rope", device=device, preset="llama-tiny")
    compiled_decode.forget_compiled(model)
    rows = [random_tokens(1, n, seed=60 + n, device=device)[0] for n in (7, 3)]
    prompt, valid = left_pad(rows)
    eager = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=30)
    greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=4, compile=True)  # compiles
    graphs = counters["stats"]["unique_graphs"]
    compiled = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=30, compile=True)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(compiled.tokens, eager.tokens)
    assert_close(compiled.logits, eager.logits)
    compiled_decode.forget_compiled(model)
