"""The engine over the paged KV cache (``aiayn.serve.blocks``): each request gets the tokens it gets
on the fixed slots; a prefix-cache hit changes no answer and skips the prompt's cached blocks; rows
of one prompt submitted together are prefilled once; admission by free blocks runs more short
requests than the same memory's fixed slots; a pool too small for every row preempts the newest
and recomputes it, with the same answers, planned on the host block tables alone (the runner has
the cache's device state follow them); a
request that can never fit is refused, the limit named; and a step reads nothing back from the
device but its tokens."""

from __future__ import annotations

import pytest
from serve_helpers import step_until, tiny_text_model
from test_engine import Collector, prompt, run_until_done, submit

from aiayn.nn.block_tables import BlockTables
from aiayn.nn.kv_cache import kv_cache_bytes
from aiayn.nn.paged_kv_cache import PagedKVCache
from aiayn.serve.blocks import block_plan
from aiayn.serve.engine import Engine, slot_plan
from aiayn.serve.runner import Runner
from aiayn.serve.scheduler import Scheduler

BLOCK = 8


@pytest.fixture(scope="module")
def lm():
    return tiny_text_model()


def paged_engine(lm, *, rows=4, context=128, chunk=16, blocks: int | None = None, prefix_caching=True) -> Engine:
    """An engine over a paged cache of ``blocks`` usable blocks of ``BLOCK`` tokens (default: as many
    as ``rows`` full contexts)."""
    budget = 1 << 30
    if blocks is not None:
        config = lm.model.config
        budget = (blocks + 1) * kv_cache_bytes(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads,
                                               head_dim=config.head_dim, seq_len=BLOCK, batch_size=1)
    plan = block_plan(lm, max_batch=rows, context=context, budget=budget, kv_cache=None, block_size=BLOCK,
                      prefix_caching=prefix_caching)
    return Engine(lm, plan, prefill_chunk=chunk)


def slots_engine(lm, *, rows=4, context=128, chunk=16) -> Engine:
    return Engine(lm, slot_plan(lm, max_batch=rows, context=context, budget=1 << 30, kv_cache=None),
                  prefill_chunk=chunk)


def answers(engine: Engine, prompts: list[list[int]], *, every: int = 0, **params) -> list[list[int]]:
    """Each prompt's tokens, submitted ``every`` steps apart (0: all at once), run to the end."""
    sinks: list[Collector] = []
    for i, ids in enumerate(prompts):
        sinks.append(submit(engine, ids, **{"seed": i, **params}))
        for _ in range(every):
            engine.step()
    run_until_done(engine, sinks)
    return [s.tokens for s in sinks]


def prefill_tokens(monkeypatch) -> list[int]:
    """Counts the prompt tokens the engine's forwards read (each prefill chunk's real tokens)."""
    counted: list[int] = []
    forward = Runner.forward

    def counting(self, plan):
        if plan.prefill:
            counted.append(sum(len(tokens) for _, tokens, _ in plan.prefill))
        return forward(self, plan)

    monkeypatch.setattr(Runner, "forward", counting)
    return counted


def test_greedy_and_sampled_tokens_equal_the_fixed_slots(lm):
    """Six staggered requests of 5 to 70 prompt tokens (chunks of 16 crossing blocks of 8): greedy and
    seeded sampling give the same tokens on the paged cache as on the fixed slots."""
    prompts = [prompt(n, seed) for seed, n in enumerate([5, 40, 17, 70, 9, 33])]
    for params in ({}, {"temperature": 0.8, "top_p": 0.9}):
        expected = answers(slots_engine(lm), prompts, every=2, **params)
        assert answers(paged_engine(lm), prompts, every=2, **params) == expected


def test_a_prefix_hit_gives_the_uncached_answer_and_skips_the_cached_blocks(lm, monkeypatch):
    shared = prompt(45, 7)
    first, second = shared + prompt(6, 8), shared + prompt(11, 9)
    uncached = answers(paged_engine(lm, prefix_caching=False), [second])
    engine = paged_engine(lm)
    counted = prefill_tokens(monkeypatch)
    answers(engine, [first])
    read_first = sum(counted)
    assert read_first == len(first)
    assert answers(engine, [second]) == uncached
    # the 5 full blocks of the shared 45 tokens (40 tokens) hit; the rest is computed
    assert sum(counted) - read_first == len(second) - 40
    assert engine.blocks is not None and engine.blocks.hit_tokens == 40
    assert engine.blocks.hit_rate == pytest.approx(40 / (len(first) + len(second)))
    assert b"aiayn_prefix_cache_hit_rate" in engine.metrics.render()


def test_an_identical_prompt_recomputes_its_last_block_only(lm, monkeypatch):
    """A repeat of a 48-token prompt (6 full blocks) holds 5 of them: the last prompt token's logits
    are needed, so its block is computed again (into a block of the row's own)."""
    ids = prompt(48, 3)
    engine = paged_engine(lm)
    counted = prefill_tokens(monkeypatch)
    first = answers(engine, [ids])
    assert answers(engine, [ids]) == first
    assert counted == [16, 16, 16, 8]


def test_rows_of_one_prompt_submitted_together_share_one_prefill(lm, monkeypatch):
    """Three requests with one 50-token prompt (n = 3 at the API) arrive at once: the first prefills
    it, the others wait for its blocks, then compute only the last partial block; each answer equals
    the prompt's answer alone (greedy, and seeded sampling with its own seed)."""
    ids = prompt(50, 5)
    alone = [answers(paged_engine(lm), [ids], temperature=0.9, seed=s)[0] for s in range(3)]
    engine = paged_engine(lm)
    counted = prefill_tokens(monkeypatch)
    sinks = [submit(engine, ids, temperature=0.9, seed=s) for s in range(3)]
    run_until_done(engine, sinks)
    assert [s.tokens for s in sinks] == alone
    assert sum(counted) == 50 + 2 * (50 - 48)


def test_admission_by_blocks_runs_more_short_requests_than_the_slots(lm):
    """The memory of 2 full contexts of 128 tokens (32 blocks of 8): the fixed slots run 2 requests
    at once, the paged cache all 8 short ones (16 prompt + 8 answer tokens: 3 blocks each)."""
    engine = paged_engine(lm, rows=8, blocks=32)
    sinks = [submit(engine, prompt(16, seed), max_tokens=8) for seed in range(8)]
    engine.step()
    assert engine.running == 8
    run_until_done(engine, sinks)
    assert engine.blocks is not None and engine.blocks.tables.pool.used == 0


def test_a_full_pool_preempts_the_newest_and_recomputes_it(lm):
    """Four requests of 30 prompt + 40 answer tokens (9 blocks each at the end) over 20 blocks: they
    all start, then run out mid-answer; the newest give their blocks back and come back later. Every
    answer equals the request's answer alone, greedy and sampled (the draws carry on)."""
    prompts = [prompt(30, seed) for seed in range(4)]
    for params in ({}, {"temperature": 0.8}):
        alone = [answers(slots_engine(lm), [ids], max_tokens=40, seed=i, **params)[0]
                 for i, ids in enumerate(prompts)]
        engine = paged_engine(lm, blocks=20)
        assert answers(engine, prompts, max_tokens=40, **params) == alone
        assert engine.metrics.preemptions._value.get() > 0
        assert engine.blocks is not None and engine.blocks.tables.pool.used == 0


def test_a_request_that_can_never_fit_is_refused_with_the_limit(lm):
    engine = paged_engine(lm, blocks=10)
    with pytest.raises(ValueError, match=r"= 90 tokens exceed the KV cache's 80 tokens \(10 blocks of 8; raise --kv-budget\)"):
        submit(engine, prompt(60, 1), max_tokens=30)
    with pytest.raises(ValueError, match="needs --kv-layout slots"):
        block_plan(lm, max_batch=2, context=64, budget=1 << 20, kv_cache="int8")


def test_the_paged_engine_step_reads_only_its_tokens(lm):
    """As tests/serve/test_no_device_reads.py for the fixed slots: prefix hits, n > 1 waits, blocks
    taken and freed, preemption: the only reads are the chosen tokens, once per sampling forward."""
    prompts = [prompt(30, seed) for seed in range(3)] + [prompt(30, 0)[:24] + prompt(9, 9)]
    expected = answers(paged_engine(lm, blocks=20), prompts, every=1, max_tokens=30)
    engine = paged_engine(lm, blocks=20)
    sinks = [submit(engine, ids, seed=i, max_tokens=30) for i, ids in enumerate(prompts)]
    reads = step_until(engine, lambda: all(s.done for s in sinks), spy=True)
    assert [s.tokens for s in sinks] == expected
    assert {r.split(" ")[0] for r in reads} <= {"choose"}, "\n".join(reads)
    assert engine.metrics.preemptions._value.get() > 0 and engine.blocks.hit_tokens > 0


def test_the_scheduler_plans_on_the_block_tables_and_only_the_runner_writes_the_cache(lm, monkeypatch):
    """Admission, prefix hits and preemption are planned on host numbers: the scheduler moves rows
    in the host block tables as it plans (no shadow ledger), no cache method that writes the device
    is called while it plans (the runner has the device follow, then runs the forward), and the
    answers are those of a pool that never preempts."""
    prompts = [prompt(30, seed) for seed in range(3)] + [prompt(30, 0)[:24] + prompt(9, 9)]
    expected = answers(paged_engine(lm), prompts, every=1, max_tokens=30)
    planning, writes = [False], []

    def noted(name, original):
        def write(self, *args, **kwargs):
            writes.append((name, planning[0]))
            return original(self, *args, **kwargs)
        return write

    def flagged(original):
        def plan(self, *args):
            planning[0] = True
            try:
                return original(self, *args)
            finally:
                planning[0] = False
        return plan

    for name in ("clear_row", "swap_rows", "adopt", "register", "reserve", "reset", "follow"):
        monkeypatch.setattr(PagedKVCache, name, noted(f"cache.{name}", getattr(PagedKVCache, name)))
    for name in ("clear", "swap", "adopt", "register", "grow"):
        monkeypatch.setattr(BlockTables, name, noted(f"tables.{name}", getattr(BlockTables, name)))
    for name in ("schedule", "update", "decode_plan"):
        monkeypatch.setattr(Scheduler, name, flagged(getattr(Scheduler, name)))
    engine = paged_engine(lm, blocks=20)
    sinks = [submit(engine, ids, seed=i, max_tokens=30) for i, ids in enumerate(prompts)]
    run_until_done(engine, sinks)
    assert [s.tokens for s in sinks] == expected
    assert engine.metrics.preemptions._value.get() > 0 and engine.blocks.hit_tokens > 0
    cache_calls = {(name, planning) for name, planning in writes if name.startswith("cache.")}
    assert cache_calls == {("cache.follow", False), ("cache.reserve", False)}
    table_calls = {(name, planning) for name, planning in writes if name.startswith("tables.")}
    assert table_calls == {("tables.clear", True), ("tables.swap", True), ("tables.adopt", True),
                           ("tables.register", True), ("tables.grow", False)}  # grown by the forward's reserve


def test_the_start_up_lines_say_what_the_budget_holds(lm):
    from aiayn.serve import build_state
    from aiayn.serve.models import ServedModel

    config = lm.model.config
    block = kv_cache_bytes(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                           seq_len=16, batch_size=1)
    _, lines = build_state(ServedModel("tiny", lm=lm), max_batch=4, context=128, kv_budget=5 * block)
    assert lines[1].startswith("KV cache (paged): 4 blocks x 16 tokens (float32)") and "prefix caching on" in lines[1]
    assert "(a request may hold at most 64 tokens: the budget of" in lines[-1] and "--context 128" in lines[-1]
    _, lines = build_state(ServedModel("tiny", lm=lm), max_batch=4, context=128, kv_layout="slots")
    assert lines[1].startswith("KV cache: 4 slots x 128 tokens (float32)")


def test_a_preempted_request_cancelled_while_it_waits_leaves_nothing_behind(lm):
    prompts = [prompt(30, seed) for seed in range(4)]
    engine = paged_engine(lm, blocks=20)
    sinks = [submit(engine, ids, max_tokens=40) for ids in prompts]
    blocks = engine.blocks
    assert blocks is not None
    for _ in range(300):
        engine.step()
        if blocks.resumed and engine.waiting:
            break
    victim = engine.waiting[0]
    engine.cancel(victim)
    run_until_done(engine, [s for s, r in zip(sinks, prompts, strict=True) if r is not victim.prompt])
    engine.step()
    assert blocks.resumed == set() and not blocks._sequence and not blocks._admitted and not blocks._decoded
    assert blocks.tables.pool.used == 0


def test_a_prompt_that_ends_on_a_block_boundary_gets_a_block_for_its_first_decode(lm):
    """A row whose prompt ends in a step's chunk decodes in the same step. Its prompt (16 tokens)
    fills its 2 blocks exactly and the other row holds the pool's other 2: the step must count that
    row's decode token and preempt, not fail for want of a block (as it once did). The answers equal
    the fixed slots' on the same schedule."""

    def schedule(engine: Engine) -> list[list[int]]:
        first = submit(engine, prompt(5, 0), max_tokens=20)
        for _ in range(6):  # the first row's 5 + 6 tokens: 2 blocks, room left in the second
            engine.step()
        second = submit(engine, prompt(16, 1), max_tokens=4)
        run_until_done(engine, [first, second])
        assert all(e.error is None for e in first.events + second.events)
        return [first.tokens, second.tokens]

    expected = schedule(slots_engine(lm, rows=2, context=64))
    engine = paged_engine(lm, rows=2, context=64, blocks=4, prefix_caching=False)
    assert schedule(engine) == expected and engine.metrics.preemptions._value.get() > 0
