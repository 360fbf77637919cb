"""Embeddings on the engine thread in slices: a large embeddings request runs
one forward at a time between decode steps, takes at most ``embed_share`` of the engine's time
while streams run (measured by the engine's own clock, which a test replaces to make the schedule
exact), and its vectors are the same bits as computed at once."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from serve_helpers import tiny_text_model
from test_engine import Collector, prompt, submit
from torch.testing import assert_close

from aiayn.serve.embedding import EmbeddingJob
from aiayn.serve.engine import Engine, QueueFull, slot_plan


@pytest.fixture(scope="module")
def lm():
    return tiny_text_model()


def engine_for(lm, *, rows: int = 4, max_queue: int = 64, embed_chunk: int = 16) -> Engine:
    plan = slot_plan(lm, max_batch=rows, context=256, budget=1 << 30, kv_cache=None)
    return Engine(lm, plan, prefill_chunk=16, max_queue=max_queue, embed_chunk=embed_chunk)


class FakeClock:
    """Each reading is one unit after the last: a step's stream forwards measure 1, and so does an
    embedding forward, plus ``extra`` units a test adds to make it look longer."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def inputs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    return [prompt(n, seed + i) for i, n in enumerate(lengths)]


def whole_forward(lm, ids: list[int]) -> torch.Tensor:
    """The unsliced, unchunked vector: one forward over the whole input (the old computation)."""
    with torch.inference_mode():
        hidden = lm.model(torch.tensor([ids])).hidden[0].float()  # (t, d)
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)


def test_sliced_embeddings_equal_the_one_batch_ones(lm):
    """Inputs of 3 to 90 tokens (chunks of 16: one forward, or up to six over a KV cache), embedded
    by an engine beside two decoding streams, one forward between steps: the same bits as the job
    run at once; an input of one chunk the same bits as one forward over it, a longer one within
    float rounding of that (its pieces attend over the cache)."""
    engine = engine_for(lm)
    engine.embeddings.clock = FakeClock()  # one forward a step, whatever the machine's hiccups
    prompts = inputs([3, 16, 17, 40, 90, 5, 33])
    streams = [submit(engine, prompt(6, 50), max_tokens=200), submit(engine, prompt(9, 51), max_tokens=200)]
    engine.step()
    job = engine.embed(prompts)
    for _ in range(200):
        if job.future.done():
            break
        engine.step()
    sliced = job.future.result()
    assert job.forwards == sum(-(-len(p) // 16) for p in prompts)  # one forward per piece of 16
    assert all(len(s.tokens) > 10 for s in streams)  # the streams went on meanwhile
    at_once = EmbeddingJob(lm, prompts, chunk=16).run()
    assert torch.equal(sliced, at_once)
    for ids, vector in zip(prompts, sliced, strict=True):
        if len(ids) <= 16:
            assert torch.equal(vector, whole_forward(lm, ids))
        else:
            assert_close(vector, whole_forward(lm, ids), rtol=1e-5, atol=1e-6)


def test_a_stream_gets_a_token_at_every_step_beside_a_large_embeddings_request(lm):
    """With every forward timed alike, each step is one decode step and one embedding forward: the
    stream never waits for more than one forward, and the embeddings still advance every step."""
    engine = engine_for(lm)
    engine.embeddings.clock = FakeClock()
    stream = submit(engine, prompt(5, 1), max_tokens=60)
    engine.step()
    job = engine.embed(inputs([8] * 40 + [70]))
    for step in range(30):
        tokens, forwards = len(stream.tokens), job.forwards
        engine.step()
        assert len(stream.tokens) == tokens + 1, f"step {step}: the stream stalled"
        assert job.forwards == forwards + 1, f"step {step}: the embeddings did not advance"


def test_a_forward_longer_than_a_decode_step_waits_for_the_steps_that_pay_for_it(lm, monkeypatch):
    """An embedding forward measured at 3 units against the streams' 1 a step: once its cost is
    known, one forward every third step, after the steps that pay for it, so the embeddings take
    half the engine's time (embed_share 0.5). The first forward, of unknown cost, goes at once
    and its debt is paid back before the next: never more than the streams' time plus one."""
    engine = engine_for(lm)
    clock = engine.embeddings.clock = FakeClock()
    forward = EmbeddingJob.forward

    def slow_forward(self):
        clock.now += 2.0  # the two readings around it add the third unit
        return forward(self)

    monkeypatch.setattr(EmbeddingJob, "forward", slow_forward)
    stream = submit(engine, prompt(5, 1), max_tokens=100)
    engine.step()
    job = engine.embed(inputs([8] * 30))
    ran_at = []
    for step in range(60):
        forwards = job.forwards
        engine.step()
        if job.forwards > forwards:
            ran_at.append(step)
    assert len(stream.tokens) == 62  # a token every step (two from the first step)
    gaps = [b - a for a, b in itertools.pairwise(ran_at)]
    assert ran_at[0] == 0 and gaps == [5] + [3] * (len(gaps) - 1) and len(gaps) > 15  # (5: the debt, then 3)
    shared = engine.embeddings.shared_seconds
    assert shared["embeddings"] <= shared["streams"] + 3.0


def test_the_share_holds_on_the_real_clock(lm, monkeypatch):
    """The same bound with real timings (whatever the machine's load: both are measured on the
    engine's thread): embedding forwards take no more of the engine's time than the streams' own
    forwards, plus one forward."""
    engine = engine_for(lm)
    longest = 0.0
    forward = EmbeddingJob.forward

    def timed(self):
        nonlocal longest
        start = time.perf_counter()
        tokens = forward(self)
        longest = max(longest, time.perf_counter() - start)
        return tokens

    monkeypatch.setattr(EmbeddingJob, "forward", timed)
    stream = submit(engine, prompt(5, 1), max_tokens=80)
    engine.step()
    job = engine.embed(inputs([60] * 60))  # 240 forwards of 16 tokens (about 80 fit beside the stream)
    while not stream.done:
        engine.step()
    shared = engine.embeddings.shared_seconds
    assert job.forwards > 0  # the embeddings ran beside the stream
    assert shared["embeddings"] <= shared["streams"] + longest + 1e-3


def test_alone_the_embeddings_take_the_whole_engine_and_small_jobs_are_not_held_behind_large(lm):
    engine = engine_for(lm)
    large = engine.embed(inputs([20] * 30))
    small = engine.embed(inputs([4, 4], seed=100))
    steps = 0
    while not small.future.done():
        engine.step()
        steps += 1
    assert steps == 4 and large.forwards == 2  # one forward a step, the jobs in turn
    while not large.future.done():
        engine.step()
    assert torch.equal(small.future.result(), EmbeddingJob(lm, inputs([4, 4], seed=100), chunk=16).run())
    metrics = engine.metrics.render().decode()
    assert f"aiayn_embedding_tokens_total {float(20 * 30 + 8)}" in metrics  # every token read, counted


def test_a_cancelled_job_is_dropped_and_a_failing_one_fails_alone(lm, monkeypatch):
    engine = engine_for(lm)
    engine.embeddings.clock = FakeClock()  # one forward a step
    stream = submit(engine, prompt(5, 1), max_tokens=30)
    gone = engine.embed(inputs([8] * 20))
    engine.step()
    engine.embeddings.cancel(gone)
    forwards = gone.forwards
    engine.step()
    assert gone.forwards == forwards and len(engine.embeddings) == 0 and gone.future.cancelled()
    broken = engine.embed(inputs([8] * 3))
    monkeypatch.setattr(EmbeddingJob, "forward", lambda self: (_ for _ in ()).throw(RuntimeError("no memory")))
    engine.step()
    with pytest.raises(RuntimeError, match="no memory"):
        broken.future.result(timeout=0)
    monkeypatch.undo()
    while not stream.done:
        engine.step()
    assert len(stream.tokens) == 30


def test_embedding_jobs_wait_in_a_bounded_queue_and_stop_with_the_engine(lm):
    engine = engine_for(lm, rows=1, max_queue=1)
    jobs = [engine.embed(inputs([4])), engine.embed(inputs([4]))]  # max_batch + max_queue of them
    with pytest.raises(QueueFull):
        engine.embed(inputs([4]))
    engine.stop()
    for job in jobs:
        with pytest.raises(Exception, match="shutting down"):
            job.future.result(timeout=0)


def test_the_queue_of_embeddings_does_not_change_what_a_stream_gets(lm):
    """A greedy stream's tokens beside embeddings are those it gets alone (the embeddings use their
    own caches, never the stream's rows)."""
    alone_engine = engine_for(lm)
    alone = submit(alone_engine, prompt(12, 3), max_tokens=20)
    while not alone.done:
        alone_engine.step()
    engine = engine_for(lm)
    beside = submit(engine, prompt(12, 3), max_tokens=20)
    engine.embed(inputs([40, 7, 90] * 5))
    while not beside.done:
        engine.step()
    assert beside.tokens == alone.tokens
    assert isinstance(beside, Collector)


def test_the_forward_cost_is_fitted_to_the_recent_forwards():
    from aiayn.serve.embedding import ForwardCost

    cost = ForwardCost()
    assert cost(100) == 0.0  # nothing seen: the first forward is not held back
    cost.observe(64, 2.0)
    assert cost(32) == pytest.approx(1.0)  # one size seen: proportional
    for _ in range(20):  # a long input's pieces: 64 tokens in 2.5 s, the last 18 in 1.2 s
        cost.observe(64, 2.5)
        cost.observe(18, 1.2)
    assert cost(64) == pytest.approx(2.5, rel=0.02) and cost(18) == pytest.approx(1.2, rel=0.05)
