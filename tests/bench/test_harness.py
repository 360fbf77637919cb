"""benchmarks/common.py's shared helpers: the rounds' figures and how they are printed."""

from __future__ import annotations

import itertools
import math

import torch

from benchmarks import common


def test_spread_text_and_median_ratio():
    assert common.spread_text([2.0, 1.0, 3.0]) == "2.0 (1.0-3.0)"
    assert common.spread_text([1.234, 1.234], 2) == "1.23"  # rounds that agree: the one value
    assert common.spread_text([float("nan")]) == "-"  # a cut run's NaN is left out
    assert common.median_ratio([4.0, 6.0, 5.0], [2.0, 2.0, 3.0]) == 2.5
    assert math.isnan(common.median_ratio([1.0], [0.0]))


def test_same_prefix_reads_tensors_and_lists_flat():
    assert common.same_prefix(torch.tensor([[1, 2, 3, 4]]), [1, 2, 9, 4]) == 2
    assert common.same_prefix([1, 2], [1, 2, 3]) == 2 and common.same_prefix([5], [6]) == 0


def test_rounds_sized_to_the_slowest_peer_and_timed_on_the_clock():
    ticks = itertools.count()
    fast, slow = common.Timed("fast", lambda: None), common.Timed("slow", lambda: sum(range(20000)))
    common.run_interleaved([fast, slow], repeats=3, warmup=1, round_seconds=0.01, clock=lambda: next(ticks))
    assert fast.iters == slow.iters >= 1 and len(fast.times) == len(slow.times) == 3
    assert fast.times == [1 / fast.iters] * 3  # the clock ticks once per read: one tick per round
    seconds, result = common.median_seconds(lambda: 7, 3)
    assert result == 7 and seconds >= 0
