"""`aiayn explain parameters`: aiayn's count is exact (formula == built model), and the gap to
Table 3 is embedding-sized, not in the layers (63.1M vs 65M explained)."""

from __future__ import annotations

import pytest

from aiayn.explain import run_topic
from aiayn.explain.parameters import ROWS, built, formula


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_topic("parameters", tmp_path_factory.mktemp("parameters"), quick=True)


def test_the_formula_is_the_built_models_count(report):
    for r in report.claims["results"]:
        if r["built"] is not None:
            assert r["built"] == r["formula"], r
    assert report.claims["total"] == 63_082_496


def test_the_gap_is_an_embedding_not_the_layers(report):
    base, d_k16, d_k32, n2 = report.claims["results"][:4]
    assert base["gap"] == pytest.approx(1.92e6, abs=0.01e6)
    assert report.claims["biases"] < 0.1e6 and report.claims["components"]["layer norms"] < 0.05e6
    # the gap does not follow N or d_k: the same number of d_model-wide rows, within the rounding
    for r in (d_k16, d_k32, n2):
        assert abs(r["gap_rows"] - base["gap_rows"]) < 2 * 0.5e6 / 512, r
    assert report.claims["base_fit"] == 40_745


def test_formula_components_on_a_row_aiayn_cannot_build():
    row = next(r for r in ROWS if r.d_k != r.d_v)
    assert built(row) is None
    base = formula(ROWS[0])
    smaller = formula(row)  # only the q and k projections shrink: 18 attention modules
    assert base["attention"] - smaller["attention"] == 18 * 2 * (512 * 8 * (64 - row.d_k) + 8 * (64 - row.d_k))
