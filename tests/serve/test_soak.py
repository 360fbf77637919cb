"""The soak of issue 34, point 7, for 60 seconds: ``python -m benchmarks.soak`` against a real
``aiayn serve`` subprocess (the shipped shakespeare-char model) on 127.0.0.1, every goal met."""

from __future__ import annotations

import pytest

from benchmarks.soak import parse_args, print_report, run_soak


@pytest.mark.slow
def test_a_minute_of_hostile_and_ordinary_clients(tmp_path, capsys):
    report = run_soak(parse_args(["--seconds", "60", "--clients", "6", "--log", str(tmp_path / "server.log")]))
    print_report(report)
    goals = report.goals()
    assert all(goals.values()), capsys.readouterr().out
    seen = report.tally.status
    # Every kind of client ran and got its answer, the overflow path included.
    for kind in ("stream", "hang-up", "embeddings", "burst"):
        assert seen[(kind, 200)] > 0, kind
    assert seen[("burst", 429)] > 0  # more than --max-batch + --max-queue at once
    assert sum(n for (kind, code), n in seen.items() if kind == "bad" and 400 <= code < 500) > 0
    assert report.tally.ttft and report.tally.itl
