"""benchmarks/staggered.py's CPU-seconds clock (``run_stepped``) on the tiny model: every request is
answered in full, and each one's time to first token is its queued, behind and prefill parts."""

from __future__ import annotations

import pytest
from serve_helpers import tiny_text_model
from test_engine import engine_for, prompt

from benchmarks.staggered import PARTS, Job, all_at_once, run_stepped


@pytest.fixture(scope="module")
def lm():
    return tiny_text_model()


def test_the_stepped_clock_answers_every_request_and_splits_its_ttft(lm):
    jobs = [Job(0.05 * i, prompt(5 + 20 * (i % 3), i), 4 + i % 3) for i in range(6)]
    for schedule in (jobs, all_at_once(jobs)):
        result = run_stepped(engine_for(lm, rows=2, chunk=16), schedule, threads=1)
        assert result["failed"] == 0 and 1 <= result["most_running"] <= 2  # (staggered: as fast as the steps go)
        assert result["tokens"] == sum(job.answer for job in jobs)  # (max_tokens: the tiny model never ends early)
        assert 0 < result["ttft_p50"] <= result["ttft_p99"] < result["seconds"]
        parts = [result[name] for name in PARTS]
        assert min(parts) >= 0
        assert sum(parts) == pytest.approx(result["ttft_mean"])  # each request's parts add up to its TTFT
    stepped = run_stepped(engine_for(lm, rows=2, chunk=16), all_at_once(jobs), threads=1)
    assert stepped["most_running"] == 2 and stepped["queued"] > 0  # two rows for six requests: some wait for a row
