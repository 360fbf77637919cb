"""The prefill schedule (``aiayn.serve.scheduler.prefill_plan``): fewest prompt tokens left first, each row taking
what is left of the step's token budget. A short request that arrives while 14 rows decode and a
long prompt prefills (16 rows) gets its first token at the next step (not after the long prompt's
every chunk), on the fixed slots and on the paged cache; the long prompt still finishes while a
short prompt arrives at every step; and every answer equals the model's alone."""

from __future__ import annotations

import random

import pytest
import torch
from serve_helpers import tiny_text_model
from test_engine import engine_for, prompt, submit
from test_prefix_cache import paged_engine

from aiayn.generate import greedy_decoder_only
from aiayn.serve.scheduler import prefill_plan


@pytest.fixture(scope="module")
def lm():
    return tiny_text_model()


def test_a_lone_prompt_takes_whole_chunks():
    assert prefill_plan([900], 256) == [(0, 256)]
    assert prefill_plan([40], 256) == [(0, 40)]
    assert prefill_plan([], 256) == []


def test_a_short_prompt_goes_first_and_the_long_one_takes_the_rest_of_the_budget():
    assert prefill_plan([900, 30], 256) == [(1, 30), (0, 226)]
    # tiny prompts beside a long one: all in the same forward (no padding to pay for)
    assert prefill_plan([900, 1, 1, 1], 256) == [(1, 1), (2, 1), (3, 1), (0, 253)]
    # equal rows: the earlier row first, whole chunks
    assert prefill_plan([300, 300], 256) == [(0, 256)]
    assert prefill_plan([200, 300], 256) == [(0, 200), (1, 56)]


def test_plans_fill_the_budget_fewest_left_first():
    rng = random.Random(0)
    for _ in range(500):
        chunk = rng.choice([1, 7, 16, 256, 512])
        remaining = [rng.choice([rng.randint(1, 8), rng.randint(1, 1000)]) for _ in range(rng.randint(1, 16))]
        plan = prefill_plan(remaining, chunk)
        rows = [i for i, _ in plan]
        keys = sorted((n, i) for i, n in enumerate(remaining))
        assert [(remaining[i], i) for i in rows] == keys[: len(rows)]  # fewest left first; the rest have more
        assert all(1 <= take <= remaining[i] for i, take in plan)
        assert all(take == remaining[i] for i, take in plan[:-1])  # only the last row may stop short
        assert sum(take for _, take in plan) == min(chunk, sum(remaining))  # the budget, or everything


def test_bad_plans_are_refused():
    with pytest.raises(ValueError):
        prefill_plan([10], 0)
    with pytest.raises(ValueError):
        prefill_plan([10, 0], 16)


def alone(lm, ids: list[int], n: int) -> list[int]:
    return greedy_decoder_only(lm.model, torch.tensor([ids]), max_new_tokens=n).tokens[0].tolist()


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_a_request_arriving_while_14_rows_decode_and_a_long_prompt_prefills_starts_at_the_next_step(lm, layout):
    """16 rows, chunks of 16: 14 short requests decode, a 100-token prompt prefills (seven chunks);
    a 5-token request arriving then has its first token after one step, the long one its own after
    at most eight, and every answer is the model's alone."""
    engine = (engine_for(lm, rows=16, context=160, chunk=16) if layout == "slots"
              else paged_engine(lm, rows=16, context=160, chunk=16))
    decoding = [submit(engine, prompt(4 + i % 3, 100 + i), max_tokens=30) for i in range(14)]
    while not all(s.events for s in decoding):
        engine.step()
    long_ids, short_ids = prompt(100, 7), prompt(5, 8)
    long = submit(engine, long_ids, max_tokens=6)
    engine.step()  # the long prompt's first chunk
    short = submit(engine, short_ids, max_tokens=6)
    engine.step()
    assert short.tokens, "the short request waited behind the long prompt's chunks"
    for _ in range(8):
        if long.tokens:
            break
        engine.step()
    assert long.tokens, "the long prompt was starved"
    while not all(s.done for s in [*decoding, long, short]):
        engine.step()
    assert short.tokens == alone(lm, short_ids, 6)
    assert long.tokens == alone(lm, long_ids, 6)
    for i, sink in enumerate(decoding):
        assert sink.tokens == alone(lm, prompt(4 + i % 3, 100 + i), 30)


def test_a_long_prompt_finishes_while_a_short_one_arrives_at_every_step(lm):
    """A 100-token prompt, chunks of 16, and a new 4-token request at each step: the short ones never
    wait, and the long one still gets its first token within twice its seven chunks."""
    engine = engine_for(lm, rows=16, context=128, chunk=16)
    long_ids = prompt(100, 3)
    long = submit(engine, long_ids, max_tokens=3)
    shorts = []
    for step in range(14):
        shorts.append(submit(engine, prompt(4, 200 + step), max_tokens=1))
        engine.step()
        assert all(s.done for s in shorts), f"step {step}: a short request waited"
        if long.tokens:
            break
    assert long.tokens, "the long prompt was starved by the short ones"
    while not long.done:
        engine.step()
    assert long.tokens == alone(lm, long_ids, 3)
