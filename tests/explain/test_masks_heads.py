"""`aiayn explain masks` and `aiayn explain heads`, reduced: masked weights are exact zeros, a
query with no visible key gives NaN / uniform / zeros by method; h heads cost the parameters and
FLOPs of one."""

from __future__ import annotations

from aiayn.explain import run_topic


def test_masks(tmp_path):
    claims = run_topic("masks", tmp_path, quick=True).claims
    assert claims["padded_weight_max"] == 0.0 and claims["causal_future_max"] == 0.0
    assert claims["row_sum_error"] < 1e-6
    assert claims["naive_nan"]  # masked_fill(-inf) + softmax on a fully masked row
    assert claims["big_negative_uniform"] < 1e-12  # -1e9: uniform over the hidden keys
    assert claims["ours_zero"] == 0.0 and claims["ours_grad_finite"]
    assert (tmp_path / "masks.png").is_file() and "| method | weights | output | NaN? |" in (
        tmp_path / "masks.md").read_text(encoding="utf-8")


def test_heads_cost_the_same(tmp_path):
    results = run_topic("heads", tmp_path, quick=True).claims["results"]
    assert [r["h"] for r in results] == [1, 2, 4, 8]
    assert len({r["params"] for r in results}) == 1
    assert len({r["flops"] for r in results}) == 1 and results[0]["flops"] > 0
    d, t, b = 128, 32, 2  # the quick size: projections 4 x 2 b t d^2, scores and values 2 x 2 b t^2 d
    assert results[0]["projection_flops"] == 4 * 2 * b * t * d * d
    assert results[0]["attention_flops"] == 2 * 2 * b * t * t * d
    assert [r["softmax_elements"] for r in results] == [b * h * t * t for h in (1, 2, 4, 8)]
