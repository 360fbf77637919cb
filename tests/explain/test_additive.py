"""`aiayn explain additive`, reduced: additive attention needs a t x t x d_k intermediate where
dot-product attention needs t x t; both learn (above chance) in a brief training. (The speed ratio
is measured by the topic, not asserted here: timings do not belong in tests.)"""

from __future__ import annotations

from aiayn.explain import run_topic


def test_additive_against_dot_product(tmp_path):
    claims = run_topic("additive", tmp_path, quick=True).claims
    longest = claims["timings"][-1]
    assert longest["t"] == 64 and all(longest[k] > 0 for k in ("dot, fused", "dot, written out", "additive"))
    assert longest["additive_mb"] == 32 * longest["scores_mb"] == 16.0  # d_k = 32 times the scores
    dot, additive = claims["results"]
    assert (dot["kind"], additive["kind"]) == ("dot-product", "additive")
    assert additive["params"] - dot["params"] == 32  # w: one head of 32
    assert dot["acc"] > 0.15 and additive["acc"] > 0.15  # 10 digits: chance is 0.1
    assert (tmp_path / "additive.png").is_file()
