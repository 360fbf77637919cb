"""The compiled decode step equals the eager cached step, and compiles once.

``compiled_decode_step`` runs the decoder stack's own ``TransformerStack.run`` through ``torch.compile``:
the same blocks, but attention over the cache's filled prefix with its length symbolic (one
graph for every step), tensor slots instead of Python ints, and Inductor's fused kernels. Each test compares it
with the eager cached decoder (itself tested against full recomputation in test_kv_cache.py) on
left-padded batches with random, far-from-uniform weights, at ``assert_close``'s default float32
tolerances. Compiling takes a few seconds per model, hence the ``slow`` mark.
"""

from __future__ import annotations

import pytest
import torch
from random_weights import randomize_
from test_kv_cache import left_pad, random_tokens
from torch.testing import assert_close

from aiayn.generate import (
    SamplingConfig,
    compiled_decode_step,
    generate_decoder_only,
    greedy_decoder_only,
)
from aiayn.models import DecoderOnly, get_preset

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")  # for the tests of CPU-only conversions

CASES = [  # (preset, positional, n_kv_heads): GPT-2-like MHA, LLaMA-like GQA/MQA, relative biases
    ("gpt-tiny", "learned", None),
    ("llama-tiny", "rope", 2),
    ("gpt-tiny", "alibi", 1),
    ("gpt-tiny", "t5", None),
]


def model_for(preset: str, positional: str, n_kv_heads: int | None, *, device: torch.device) -> DecoderOnly:
    """Seeded on the CPU (the same weights on every device), then moved to ``device``."""
    torch.manual_seed(0)
    config = get_preset(preset, positional=positional, n_kv_heads=n_kv_heads)
    return randomize_(DecoderOnly(config), 0).eval().to(device)


@pytest.mark.parametrize(("preset", "positional", "n_kv_heads"), CASES)
def test_compiled_greedy_equals_eager_on_a_left_padded_batch(preset: str, positional: str,
                                                             n_kv_heads: int | None, device: torch.device) -> None:
    model = model_for(preset, positional, n_kv_heads, device=device)
    rows = [random_tokens(1, n, seed=40 + n, device=device)[0] for n in (6, 3, 1)]
    prompt, valid = left_pad(rows)
    eager = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=12)
    compiled = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=12, compile=True)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert_close(compiled.logits, eager.logits)


@pytest.mark.parametrize(("preset", "positional", "n_kv_heads"), CASES)
def test_the_whole_buffer_layout_equals_eager(preset: str, positional: str, n_kv_heads: int | None,
                                              device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout a GPU's compiled step uses (attention over every cache slot under the validity
    mask: static shapes for CUDA graphs), on whatever device the tests run: the eager tokens and
    logits on a left-padded batch, and the cache as the eager path leaves it."""
    from aiayn.fast import compiled_decode

    monkeypatch.setattr(compiled_decode, "WHOLE_BUFFER_DEVICES", (device.type,))
    model = model_for(preset, positional, n_kv_heads, device=device)
    compiled_decode.forget_compiled(model)
    rows = [random_tokens(1, n, seed=50 + n, device=device)[0] for n in (5, 2, 4)]
    prompt, valid = left_pad(rows)
    eager = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=10)
    compiled = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=10, compile=True)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert_close(compiled.logits, eager.logits)
    compiled_decode.forget_compiled(model)


def test_compiled_sampling_equals_eager_and_cache_stays_usable(device: torch.device) -> None:
    model = model_for("llama-tiny", "rope", 2, device=device)
    prompt = random_tokens(2, 5, seed=3, device=device)
    sampling = SamplingConfig(temperature=0.8, top_k=20, seed=11)
    eager = generate_decoder_only(model, prompt, max_new_tokens=10, sampling=sampling)
    compiled = generate_decoder_only(model, prompt, max_new_tokens=10, sampling=sampling, compile=True)
    assert torch.equal(compiled, eager)

    # After compiled steps the cache's bookkeeping (length, valid, positions) is what the eager
    # path expects: an eager step continues it exactly as an all-eager run would.
    with torch.inference_mode():
        cache_a, cache_b = model.new_cache(2, 12), model.new_cache(2, 12)
        model(prompt, cache=cache_a)
        model(prompt, cache=cache_b)
        step = prompt[:, -1:]
        for _ in range(3):
            compiled_decode_step(model, step, cache_a)
            model(step, cache=cache_b)
        assert cache_a.length == cache_b.length == 8
        assert torch.equal(cache_a.valid, cache_b.valid)
        assert torch.equal(cache_a.positions, cache_b.positions)
        assert_close(model(step, cache=cache_a).logits, model(step, cache=cache_b).logits)


def test_compiled_decoding_refuses_what_it_cannot_do(device: torch.device) -> None:
    model = model_for("gpt-tiny", "learned", None, device=device)
    prompt = random_tokens(1, 4, device=device)
    with pytest.raises(ValueError, match="float KV cache"):
        generate_decoder_only(model, prompt, max_new_tokens=3, kv_cache="int8", compile=True)
    with pytest.raises(ValueError, match="use_cache=True"):
        greedy_decoder_only(model, prompt, max_new_tokens=3, use_cache=False, compile=True)
    with torch.inference_mode():
        cache = model.new_cache(1, 5)
        model(prompt, cache=cache)
        with pytest.raises(ValueError, match="one token per row"):
            compiled_decode_step(model, prompt[:, :2], cache)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            compiled_decode_step(model, torch.tensor([[500]], device=device), cache)
        compiled_decode_step(model, prompt[:, :1], cache)
        with pytest.raises(ValueError, match="KV cache is full"):
            compiled_decode_step(model, prompt[:, :1], cache)


def test_one_graph_serves_every_step_and_prompt_length(device: torch.device) -> None:
    """The filled prefix's length is dynamic: decoding many steps, then another prompt length into
    the same cache size, adds at most one graph (none if an earlier test built it)."""
    from torch._dynamo.utils import counters

    model = model_for("gpt-tiny", "learned", None, device=device)
    before = counters["stats"]["unique_graphs"]
    first = greedy_decoder_only(model, random_tokens(3, 5, seed=21, device=device), max_new_tokens=20,
                                compile=True)
    after_first = counters["stats"]["unique_graphs"]
    second = greedy_decoder_only(model, random_tokens(3, 9, seed=22, device=device), max_new_tokens=16,
                                 compile=True)
    assert after_first - before <= 1
    assert counters["stats"]["unique_graphs"] == after_first  # 5 + 20 and 9 + 16 share the 64-slot cache
    assert first.tokens.shape == (3, 20) and second.tokens.shape == (3, 16)


def test_each_model_decodes_with_its_own_graph(device: torch.device) -> None:
    """Compiled graphs are not guarded on the model's submodules (aiayn.fast.compiled_decode keeps
    one compiled step per model instead): two models of one architecture but different weights,
    interleaved, and a third built after the first is freed (it may reuse its id()), each decode
    as their own eager step does."""
    import gc

    prompt = random_tokens(2, 5, seed=8, device=device)

    def check(model: DecoderOnly) -> torch.Tensor:
        eager = greedy_decoder_only(model, prompt, max_new_tokens=8)
        compiled = greedy_decoder_only(model, prompt, max_new_tokens=8, compile=True)
        assert torch.equal(compiled.tokens, eager.tokens)
        assert_close(compiled.logits, eager.logits)
        return eager.logits

    config = get_preset("llama-tiny", positional="rope", n_kv_heads=2)
    first, second = (randomize_(DecoderOnly(config), seed).eval().to(device) for seed in (1, 2))
    logits_first, logits_second = check(first), check(second)
    assert not torch.allclose(logits_first, logits_second)  # the two models really differ
    check(first)
    del first
    gc.collect()
    check(randomize_(DecoderOnly(config), 3).eval().to(device))


@pytest.mark.cpu_only  # optimize and lower_precision swap in aiayn.fast's CPU kernels
def test_changing_a_model_in_place_recompiles_its_graph() -> None:
    """aiayn's converters forget a model's compiled graph (its layers or dtype change in place);
    ``forget_compiled`` does the same after a change made by hand (new weights: the graph holds the
    old ones as constants)."""
    from aiayn.fast.compiled_decode import forget_compiled
    from aiayn.fast.convert import optimize, plain
    from aiayn.fast.quantize import lower_precision

    model = model_for("llama-tiny", "rope", 2, device=CPU)
    prompt = random_tokens(1, 5, seed=9, device=CPU)
    for change in (lambda: optimize(model), lambda: plain(model), lambda: lower_precision(model, "int8"),
                   lambda: (randomize_(model, 4), forget_compiled(model))):
        change()
        eager = greedy_decoder_only(model, prompt, max_new_tokens=6)
        compiled = greedy_decoder_only(model, prompt, max_new_tokens=6, compile=True)
        assert torch.equal(compiled.tokens, eager.tokens)
        assert_close(compiled.logits, eager.logits)


@pytest.mark.cpu_only  # Inductor's C++ wrapper and the 4-bit kernel are CPU code
def test_a_cpp_wrapper_step_equals_eager_with_4_bit_layers() -> None:
    """torch's ``TORCHINDUCTOR_CPP_WRAPPER=1`` (Inductor's ``cpp_wrapper``: the graph's calls made from
    C++ instead of Python; docs/q4.md measures it) runs the same step, aiayn's 4-bit kernel included."""
    import torch._inductor.config as inductor_config

    from aiayn.fast.quantize import lower_precision

    model = lower_precision(model_for("llama-tiny", "rope", 2, device=CPU), "q4")  # a new model: its first compiled step
    prompt = random_tokens(2, 5, seed=5, device=CPU)
    eager = greedy_decoder_only(model, prompt, max_new_tokens=8)
    with inductor_config.patch(cpp_wrapper=True):
        compiled = greedy_decoder_only(model, prompt, max_new_tokens=8, compile=True)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert_close(compiled.logits, eager.logits)
