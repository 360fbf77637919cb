"""The engine on its own (no HTTP, stepped by hand): continuous batching gives every request the
tokens it gets alone, prefill in chunks keeps the other streams going, finished or cancelled
requests give their slot back at once, and the queue has a limit."""

from __future__ import annotations

import time

import pytest
import torch
from serve_helpers import tiny_text_model
from torch.testing import assert_close

from aiayn.generate import (
    SamplingConfig,
    generate_decoder_only,
    greedy_decoder_only,
    stream_decoder_only,
)
from aiayn.serve.engine import Engine, QueueFull, Request, SamplingParams, slot_plan


@pytest.fixture(scope="module")
def lm():
    return tiny_text_model()


def engine_for(lm, *, rows=4, context=128, chunk=16, max_queue=64, kv_cache=None) -> Engine:
    plan = slot_plan(lm, max_batch=rows, context=context, budget=1 << 30, kv_cache=kv_cache)
    return Engine(lm, plan, kv_cache=kv_cache, prefill_chunk=chunk, max_queue=max_queue)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Collector:
    """A request's events (its sink)."""

    def __init__(self) -> None:
        self.events = []

    def __call__(self, event) -> None:
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].finish_reason is not None


SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty", "seed")  # SamplingConfig's fields


def submit(engine, ids, **params) -> Collector:
    sink = Collector()
    sampling = SamplingConfig(**{"temperature": 0.0, **{k: v for k, v in params.items() if k in SAMPLING}})
    rest = {"max_tokens": 12, **{k: v for k, v in params.items() if k not in SAMPLING}}
    engine.submit(Request(ids, SamplingParams(sampling=sampling, **rest), sink))
    return sink


def run_until_done(engine, sinks, limit=500) -> None:
    for _ in range(limit):
        if all(s.done for s in sinks):
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_greedy_tokens_alone_equal_a_staggered_full_batch(lm):
    """Six requests (prompts of 5 to 70 tokens, chunked by 16) on 4 slots, arriving at different
    steps: each gets exactly the tokens of the library's decode loop run on it alone, and the
    log-probabilities of its tokens are that loop's logits."""
    engine = engine_for(lm)
    lengths = [5, 40, 17, 70, 9, 33]
    prompts = [prompt(n, seed) for seed, n in enumerate(lengths)]
    sinks = []
    for i, ids in enumerate(prompts):
        sinks.append(submit(engine, ids, max_tokens=10 + i, logprobs=0))
        for _ in range(i % 3):  # stagger: 0, 1 or 2 steps between arrivals
            engine.step()
    run_until_done(engine, sinks)
    assert engine.running == 0
    for ids, sink in zip(prompts, sinks, strict=True):
        alone = greedy_decoder_only(lm.model, torch.tensor([ids]), max_new_tokens=len(sink.tokens))
        assert sink.tokens == alone.tokens[0].tolist()
        n = len(sink.tokens)
        expected = torch.log_softmax(alone.logits[0], dim=-1)[torch.arange(n), alone.tokens[0]]  # (n,)
        assert_close(torch.tensor([e.logprob.logprob for e in sink.events]), expected)
        assert sink.events[-1].finish_reason == "length"


def test_seeded_sampling_equals_the_library_alone(lm):
    """A seeded request draws the same tokens in a batch as the library's sampler alone."""
    engine = engine_for(lm)
    ids = prompt(12, 9)
    sinks = [submit(engine, prompt(20, 3), max_tokens=8),  # greedy neighbours
             submit(engine, ids, temperature=0.8, top_p=0.9, seed=1234, max_tokens=15),
             submit(engine, prompt(7, 4), temperature=1.0, seed=5, max_tokens=9)]
    run_until_done(engine, sinks)
    alone = generate_decoder_only(lm.model, torch.tensor([ids]), max_new_tokens=15,
                                  sampling=SamplingConfig(temperature=0.8, top_p=0.9, seed=1234))
    assert sinks[1].tokens == alone[0].tolist()


def test_int8_kv_cache_equals_the_library_int8_cache(lm):
    engine = engine_for(lm, kv_cache="int8")
    prompts = [prompt(n, 20 + n) for n in (6, 30, 11)]
    sinks = [submit(engine, ids, max_tokens=10) for ids in prompts]
    run_until_done(engine, sinks)
    for ids, sink in zip(prompts, sinks, strict=True):
        steps = stream_decoder_only(lm.model, torch.tensor([ids]), max_new_tokens=10, kv_cache="int8")
        assert sink.tokens == [int(s.tokens[0]) for s in steps]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(lm, monkeypatch):
    engine = engine_for(lm, chunk=16)
    forwards = spy_forwards(engine, monkeypatch)
    short = submit(engine, prompt(4, 1), max_tokens=40)
    engine.step()  # the short request prefills and gets its first token
    assert len(short.tokens) == 2  # ... and decodes in the same step (nothing else was decoding)
    assert forwards == [[(1, 4)], [(1, 1)]]  # its prompt alone, then its first decode
    long = submit(engine, prompt(100, 2), max_tokens=5)
    for step in range(7):  # 100 prompt tokens in chunks of 16: seven steps
        before, forwards[:] = len(short.tokens), []
        engine.step()
        assert len(short.tokens) == before + 1, f"step {step}: the decoding stream stalled"
        # The short row's token and the chunk in one forward; the long prompt's first token at its
        # last chunk, its second at the next step.
        chunk = (1, 16 if step < 6 else 4)  # (rows, tokens per row) of the prefill chunk
        assert forwards == [[(1, 1), chunk]]
        assert len(long.tokens) == (1 if step == 6 else 0)
    run_until_done(engine, [short, long])
    assert long.tokens == greedy_alone(lm, prompt(100, 2), 5) and short.tokens == greedy_alone(lm, prompt(4, 1), 40)


def spy_forwards(engine: Engine, monkeypatch) -> list[list[tuple[int, int]]]:
    """Record each forward of ``engine``: (rows, widest row's tokens) of each of its batches."""
    forwards: list[list[tuple[int, int]]] = []
    ragged = engine.model.decoder.forward_ragged

    def spy(batches):
        forwards.append([(len(batch.counts), max(batch.counts)) for batch in batches])
        return ragged(batches)

    monkeypatch.setattr(engine.model.decoder, "forward_ragged", spy)
    return forwards


def greedy_alone(lm, ids: list[int], n: int) -> list[int]:
    steps = stream_decoder_only(lm.model, torch.tensor([ids]), max_new_tokens=n)
    return [int(s.tokens[0]) for s in steps]


def test_a_finished_request_frees_its_slot_in_the_same_step(lm):
    engine = engine_for(lm, rows=2)
    first = submit(engine, prompt(5, 1), max_tokens=3)
    second = submit(engine, prompt(9, 2), max_tokens=30)
    engine.step()  # both prefill; each has 2 tokens
    engine.step()  # first reaches 3 tokens and leaves
    assert first.done and engine.running == 1 and engine.rows[0].prompt == prompt(9, 2)
    assert engine.cache.lengths[1] == 0 and not bool(engine.cache.valid[1].any())
    third = submit(engine, prompt(6, 3), max_tokens=3)
    engine.step()  # third prefills beside second's decode, one forward: its first token
    assert len(third.tokens) == 1 and engine.running == 2
    run_until_done(engine, [second, third])
    assert engine.running == 0 and int(engine.cache.lengths.sum()) == 0


def test_a_cancelled_request_leaves_at_the_next_step(lm):
    engine = engine_for(lm)
    keep = submit(engine, prompt(8, 1), max_tokens=20)
    gone = Collector()
    request = Request(prompt(8, 2), SamplingParams(max_tokens=20, sampling=SamplingConfig(temperature=0.0)), gone)
    engine.submit(request)
    engine.step()
    engine.cancel(request)
    count = len(gone.events)
    engine.step()
    assert engine.running == 1 and len(gone.events) == count
    run_until_done(engine, [keep])
    alone = greedy_decoder_only(lm.model, torch.tensor([prompt(8, 1)]), max_new_tokens=20)
    assert keep.tokens == alone.tokens[0].tolist()


def test_the_queue_has_a_limit_and_a_cancelled_request_leaves_it(lm):
    engine = engine_for(lm, rows=1, max_queue=1)
    submit(engine, prompt(5, 1))
    waiting = Request(prompt(5, 2), SamplingParams(max_tokens=4, sampling=SamplingConfig(temperature=0.0)), Collector())
    engine.submit(waiting)  # one for the free slot, one waiting
    with pytest.raises(QueueFull) as info:
        submit(engine, prompt(5, 3))
    assert info.value.retry_after >= 1
    engine.cancel(waiting)
    submit(engine, prompt(5, 3))  # its place in the queue is free at once
    with pytest.raises(ValueError, match="exceed the context of 128"):
        submit(engine, prompt(100, 4), max_tokens=29)


def test_the_slot_plan_follows_the_budget(lm):
    one = slot_plan(lm, max_batch=16, context=128, budget=1 << 30, kv_cache=None).bytes_per_row
    assert one == 2 * 2 * 2 * 8 * 128 * 4  # k and v x 2 layers x 2 kv heads x head_dim 8 x 128 x float32
    plan = slot_plan(lm, max_batch=16, context=128, budget=3 * one + 1, kv_cache=None)
    assert plan.rows == 3 and "up to 3 concurrent requests" in plan.describe(3 * one + 1)
    assert slot_plan(lm, max_batch=16, context=128, budget=3 * one, kv_cache="int8").rows > 3
    with pytest.raises(ValueError, match="more than the budget"):
        slot_plan(lm, max_batch=4, context=128, budget=one - 1, kv_cache=None)
    with pytest.raises(ValueError, match="more than the model's 256"):
        slot_plan(lm, max_batch=4, context=512, budget=1 << 30, kv_cache=None)


def test_a_failing_step_fails_the_running_requests_and_the_engine_goes_on(lm, monkeypatch):
    engine = engine_for(lm)
    broken = submit(engine, prompt(5, 1))
    monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("no memory left")))
    engine.start()
    try:
        for _ in range(500):
            if broken.done:
                break
            time.sleep(0.01)
        assert broken.events[-1].finish_reason == "error" and "RuntimeError: no memory left" in broken.events[-1].error
        assert engine.running == 0 and not engine.waiting
        monkeypatch.undo()  # the engine serves the next request
        after = submit(engine, prompt(5, 2), max_tokens=3)
        for _ in range(500):
            if after.done:
                break
            time.sleep(0.01)
        assert after.tokens and after.events[-1].finish_reason == "length"
    finally:
        engine.stop()


def test_q4_weights_in_the_engine_follow_the_q4_model_alone():
    """--quantize q4: the engine runs the 4-bit packed model (aiayn.fast.q4), and each request in a
    staggered batch gets the tokens that same packed model gives it alone up to the first near tie.
    Not bit for bit as in float32: the kernel rounds activations to int8 per block (as llama.cpp),
    and a float-rounding difference between the chunked, batched prefill and the one-piece one can
    tip that rounding; so a top-2 logit margin under 0.05 may flip, larger ones may not."""
    from aiayn.fast.q4 import BlockLinear
    from aiayn.fast.quantize import lower_precision

    lm = tiny_text_model(d_model=64, n_heads=4, n_kv_heads=2, d_ff=64)  # widths of whole 32-blocks
    lm.model = lower_precision(lm.model, "q4")
    assert any(isinstance(m, BlockLinear) for m in lm.model.modules())
    engine = engine_for(lm)
    prompts = [prompt(n, seed) for seed, n in enumerate([6, 35, 12, 50])]
    sinks = []
    for ids in prompts:
        sinks.append(submit(engine, ids, max_tokens=8, logprobs=0))
        engine.step()
    run_until_done(engine, sinks)
    compared = 0
    for ids, sink in zip(prompts, sinks, strict=True):
        alone = greedy_decoder_only(lm.model, torch.tensor([ids]), max_new_tokens=len(sink.tokens))
        top2 = alone.logits[0].topk(2, dim=-1).values  # (n, 2)
        for step, (got, want) in enumerate(zip(sink.tokens, alone.tokens[0].tolist(), strict=True)):
            if float(top2[step, 0] - top2[step, 1]) < 0.05:
                break  # a near tie: past here the two paths may part
            assert got == want, (ids, step)
            compared += 1
    assert compared >= 12  # most steps were compared


def test_the_engine_thread_runs_on_the_threads_it_was_given(lm):
    """`aiayn serve` loads on one torch thread and hands the threads asked for to the engine's own
    thread, where every forward runs (OpenMP pools per thread: see aiayn/cli/serve.py)."""
    plan = slot_plan(lm, max_batch=2, context=64, budget=1 << 30, kv_cache=None)
    before = torch.get_num_threads()
    given = 1 if before != 1 else 2
    engine = Engine(lm, plan, threads=given)
    seen: list[int] = []  # the sink runs on the engine thread
    engine.submit(Request([1, 2, 3], SamplingParams(max_tokens=1), lambda event: seen.append(torch.get_num_threads())))
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [given]
    finally:
        engine.stop()
    assert torch.get_num_threads() == before  # the calling thread keeps its own
