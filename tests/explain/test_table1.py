"""`aiayn explain table1`, reduced: FLOPs follow Table 1's formulas (so attention's pass the
recurrent layer's at n = d), path lengths are measured by gradients."""

from __future__ import annotations

import math

import pytest
from aiayn.explain.table1 import KERNEL

from aiayn.explain import run_topic


@pytest.fixture(scope="module")
def claims(tmp_path_factory):
    return run_topic("table1", tmp_path_factory.mktemp("table1"), quick=True).claims


def test_flops_follow_the_formulas(claims):
    r = claims["radius"]
    for n in claims["lengths"]:
        for d in claims["widths"]:
            flops = {kind: claims["flops"][kind, n, d] for kind in ("self-attention", "restricted", "convolution")}
            assert flops == {"self-attention": 4 * n * n * d, "restricted": 4 * n * (2 * r + 1) * d,
                             "convolution": 2 * KERNEL * n * d * d}
    assert [c["flops_equal"] for c in claims["crossover"]] == pytest.approx(claims["widths"])  # n = d


def test_path_lengths(claims):
    n, r, paths = 16, claims["radius"], claims["paths"]
    assert paths["self-attention"] == 1
    assert paths["restricted"] == math.ceil((n - 1) / r)
    assert paths["convolution"] == n - 1  # kernel 3: one position per layer
    assert math.log(n, KERNEL) <= paths["dilated convolution"] < paths["convolution"]
    assert paths["recurrent"] == n - 1


def test_every_timing_is_there(claims):
    assert len(claims["timings"]) == 4 * len(claims["lengths"]) * len(claims["widths"])
    assert all(ms > 0 for ms in claims["timings"].values())
