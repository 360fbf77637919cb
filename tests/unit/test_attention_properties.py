"""Property tests of ``scaled_dot_product_attention`` over random shapes and random bool masks.

For any shape (batch, h query heads sharing h_kv key/value heads, t_q <= t_k, head width) and any
mask (True = may attend), broadcast over heads and/or queries or not:

* the fused path equals the reference path;
* a query that sees no key outputs exactly zero (and no NaN), in both paths;
* the weights of every query that sees a key sum to 1 (and are zero on masked keys);
* permuting the keys, the values and the mask's key axis the same way changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from aiayn.nn.attention import scaled_dot_product_attention
from aiayn.nn.masks import causal_mask

SETTINGS = settings(max_examples=30, deadline=None)
IMPLS = ("fused", "reference")

def sdpa(q, k, v, *, impl: str, need_weights: bool = False, **kw):
    """``impl="fused"``: the one-kernel path (``F.scaled_dot_product_attention``); ``"reference"``:
    the equation written out, the path ``need_weights=True`` takes."""
    out, weights = scaled_dot_product_attention(q, k, v, need_weights=need_weights or impl == "reference", **kw)
    return out, weights if need_weights else None



@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor  # bool, broadcastable to (b, h, t_q, t_k)
    causal: bool
    seed: int

    @property
    def allowed(self) -> torch.Tensor:
        """The effective (b, h, t_q, t_k) mask, causal part included."""
        b, h, t_q, _ = self.q.shape
        t_k = self.k.shape[2]
        allowed = self.mask.expand(b, h, t_q, t_k)
        return allowed & causal_mask(t_q, t_k) if self.causal else allowed


@st.composite
def cases(draw, allow_causal: bool = True) -> Case:
    b = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 3))
    h = h_kv * draw(st.integers(1, 3))  # h_kv divides h
    t_q = draw(st.integers(1, 7))
    t_k = draw(st.integers(t_q, 9))
    d_h = draw(st.integers(1, 8))
    # Mask broadcast pattern: full, per key only (padding), or shared across heads.
    mask_shape = draw(st.sampled_from([(b, h, t_q, t_k), (b, 1, 1, t_k), (b, 1, t_q, t_k)]))
    p_visible = draw(st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]))
    causal = draw(st.booleans()) if allow_causal else False
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t_q, d_h, generator=g)
    k = torch.randn(b, h_kv, t_k, d_h, generator=g)
    v = torch.randn(b, h_kv, t_k, d_h, generator=g)
    mask = torch.rand(mask_shape, generator=g) < p_visible
    return Case(q, k, v, mask, causal, seed)


def attend(case: Case, impl: str, **kw):
    return sdpa(case.q, case.k, case.v, mask=case.mask,
                                        causal=case.causal, impl=impl, **kw)


@SETTINGS
@given(cases())
def test_fused_equals_reference(case: Case):
    fused, _ = attend(case, "fused")
    ref, _ = attend(case, "reference")
    ref_w, _ = attend(case, "fused", need_weights=True)
    assert_close(fused, ref)
    assert_close(ref_w, ref)


@SETTINGS
@given(cases())
def test_queries_without_visible_keys_output_exact_zeros(case: Case):
    dead = ~case.allowed.any(dim=-1)  # (b, h, t_q)
    for impl in IMPLS:
        for need_weights in (False, True):
            out, weights = attend(case, impl, need_weights=need_weights)
            assert torch.isfinite(out).all()
            assert torch.equal(out[dead], torch.zeros_like(out[dead]))
            if need_weights:
                assert weights is not None and torch.isfinite(weights).all()
                assert torch.equal(weights[dead], torch.zeros_like(weights[dead]))


@SETTINGS
@given(cases())
def test_weights_sum_to_one_over_visible_keys(case: Case):
    allowed = case.allowed
    live = allowed.any(dim=-1)
    for impl in IMPLS:
        _, weights = attend(case, impl, need_weights=True)
        assert weights is not None and weights.shape == allowed.shape
        assert (weights >= 0).all()
        assert torch.equal(weights[~allowed], torch.zeros_like(weights[~allowed]))
        sums = weights.sum(dim=-1)
        assert_close(sums[live], torch.ones_like(sums[live]))


@SETTINGS
@given(cases(allow_causal=False), st.data())
def test_permuting_keys_values_and_mask_together_changes_nothing(case: Case, data):
    t_k = case.k.shape[2]
    perm = torch.tensor(data.draw(st.permutations(range(t_k))), dtype=torch.long)
    # Also cover the causal mask: materialise it, then permute it with the keys.
    causal = data.draw(st.booleans())
    mask = case.mask & causal_mask(case.q.shape[2], t_k) if causal else case.mask
    for impl in IMPLS:
        out, _ = sdpa(case.q, case.k, case.v, mask=mask, impl=impl)
        out_p, _ = sdpa(case.q, case.k[:, :, perm], case.v[:, :, perm],
                                                mask=mask[..., perm], impl=impl)
        assert_close(out_p, out)
