"""`aiayn explain scaling`, reduced: q·k's variance is d_k, 1 once scaled; unscaled the softmax
saturates and its gradient vanishes as d_k grows, scaled it does not."""

from __future__ import annotations

import pytest

from aiayn.explain import run_topic


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_topic("scaling", tmp_path_factory.mktemp("scaling"), quick=True)


def test_variance_is_d_k_before_and_one_after_scaling(report):
    for r in report.claims["results"]:
        assert r["var"] / r["d_k"] == pytest.approx(1.0, abs=0.1), r
        assert r["var_scaled"] == pytest.approx(1.0, abs=0.1), r


def test_unscaled_softmax_saturates_and_loses_its_gradient(report):
    results = report.claims["results"]
    unscaled = [r["max_weight"] for r in results]
    assert unscaled == sorted(unscaled) and unscaled[-1] > 0.85  # sharper with every d_k
    assert all(0.05 < r["max_weight_scaled"] < 0.2 for r in results)  # the same at every d_k
    big = results[-1]  # d_k = 256
    assert big["one_hot"] > 0.3 and big["one_hot_scaled"] == 0.0
    assert big["grad_median"] * 5 < big["grad_median_scaled"]
    scaled = [r["grad_median_scaled"] for r in results]
    assert max(scaled) < 1.3 * min(scaled)


def test_page_and_plot(report, tmp_path_factory):
    page = report.markdown("aiayn explain scaling --quick", "aiayn/explain/scaling.py")
    assert "| d_k | var(q·k) |" in page and "![scaling](scaling.png)" in page
    assert f"{report.claims['largest']['max_weight']:.3f}" in page  # the text quotes the measured numbers
    assert report.plots[0].read_bytes()[:4] == b"\x89PNG"
