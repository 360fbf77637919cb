"""``python -m benchmarks.shared_machine``: it runs its two jobs alone and
together and prints its table (tiny sizes; the figures are not checked), and its report computes
the ratios it prints from the rounds it was given."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import shared_machine
from benchmarks.shared_machine import Policy, report


@pytest.mark.slow  # two aiayn trainings and a translator in subprocesses: ~30 s on an idle 2-core machine
def test_the_benchmark_runs_and_prints_its_table(capsys):
    shared_machine.main(["--quick", "--only", "aiayn"])
    out = capsys.readouterr().out
    assert "| policy | environment | A alone s | A beside B s | A slowdown |" in out
    assert "| aiayn | (the command's default) |" in out
    assert "goal A beside B <= 2.5x A alone, aiayn:" in out


def test_the_report_divides_the_medians_of_its_rounds(capsys):
    old = Policy("old", dict(shared_machine.OLD), a_alone=[10.0, 12.0, 11.0], a_shared=[200.0, 300.0, 250.0],
                 a_alone_loop=[8.0, 8.0, 8.0], a_shared_loop=[240.0, 240.0, 240.0],
                 b_alone=[4.0, 4.0, 4.0], b_shared=[0.5, 0.5, 0.5])
    fix = Policy("aiayn", {}, a_alone=[11.0, 11.0, 11.0], a_shared=[22.0, 23.0, 21.0],
                 a_alone_loop=[8.8, 8.8, 8.8], a_shared_loop=[18.0, 18.0, 18.0],
                 b_alone=[3.6, 3.6, 3.6], b_shared=[2.0, 2.0, 2.0], a_shared_cut=False)
    old.a_shared_cut = True
    args = argparse.Namespace(steps=None, model="multi30k-en-de", repeats=3, goal=2.5)
    report([old, fix], args)
    out = capsys.readouterr().out
    assert "| old | AIAYN_SHARE_CPUS=0 GOMP_SPINCOUNT=300000 | 11.0 (10.0-12.0) | >=250.0 (200.0-300.0) | **>=22.73x** |" in out
    assert "| aiayn | (the command's default) | 11.0 | 22.0 (21.0-23.0) | **2.00x** |" in out
    assert "| 4.00 | 0.50 | 8.00x |" in out and "| 3.60 | 2.00 | 1.80x |" in out
    assert "aiayn / old, alone (1.00 = no loss): A's wall time 1.00, A's loop 1.10, B's rate 0.90" in out
    assert "goal A beside B <= 2.5x A alone, old: not met" in out
    assert "goal A beside B <= 2.5x A alone, aiayn: met" in out
