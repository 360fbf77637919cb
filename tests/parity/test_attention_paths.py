"""The two paths of ``scaled_dot_product_attention`` agree with each other and with the formula.

``impl="fused"`` calls ``F.scaled_dot_product_attention``; ``impl="reference"`` (and every call with
``need_weights=True``) writes equation (1) out. Both are checked here against a third, hand-written
einsum/softmax version, for every masking feature: key padding, causal (square and right-aligned),
additive bias, mask + bias, grouped-query attention, and queries that see no key at all.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from aiayn.nn.attention import scaled_dot_product_attention
from aiayn.nn.masks import causal_mask, key_mask

B, H, D_H = 3, 6, 7  # odd head width on purpose

def sdpa(q, k, v, *, impl: str, need_weights: bool = False, **kw):
    """``impl="fused"``: the one-kernel path (``F.scaled_dot_product_attention``); ``"reference"``:
    the equation written out, the path ``need_weights=True`` takes."""
    out, weights = scaled_dot_product_attention(q, k, v, need_weights=need_weights or impl == "reference", **kw)
    return out, weights if need_weights else None



def formula(q, k, v, *, mask=None, bias=None, causal=False, scale=None):
    """softmax(q k^T * scale + bias, masked) v with explicit group indexing; rows that see no key
    get zero weights and a zero output. Returns (output, weights)."""
    b, h, t_q, d_h = q.shape
    h_kv, t_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d_h) if scale is None else scale
    dev = q.device
    kv_head = torch.arange(h, device=dev) // (h // h_kv)  # query head i reads key/value head i // group
    k_full, v_full = k[:, kv_head], v[:, kv_head]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k_full) * scale
    if bias is not None:
        scores = scores + bias
    allowed = torch.ones(b, h, t_q, t_k, dtype=torch.bool, device=dev)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        q_pos = torch.arange(t_k - t_q, t_k, device=dev)[:, None]
        allowed = allowed & (torch.arange(t_k, device=dev)[None, :] <= q_pos)
    scores = scores.masked_fill(~allowed, float("-inf"))
    any_visible = allowed.any(dim=-1, keepdim=True)
    weights = torch.where(any_visible, torch.softmax(scores, dim=-1), torch.zeros((), device=dev))
    return torch.einsum("bhqk,bhkd->bhqd", weights, v_full), weights


def make_qkv(t_q, t_k, h_kv=H, seed=0, requires_grad=False, *, device: torch.device):
    """(q, k, v) drawn on the CPU (the same numbers on every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, t_q, D_H, generator=g).to(device)
    k = torch.randn(B, h_kv, t_k, D_H, generator=g).to(device)
    v = torch.randn(B, h_kv, t_k, D_H, generator=g).to(device)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def padding(t_k: int, device: torch.device) -> torch.Tensor:
    """(B, 1, 1, t_k): row 0 unpadded, the others with 1 and 3 trailing pads."""
    valid = torch.ones(B, t_k, dtype=torch.bool, device=device)
    valid[1, -1:] = False
    valid[2, -3:] = False
    return key_mask(valid)


def random_bias(t_q: int, t_k: int, device: torch.device, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, H, t_q, t_k, generator=torch.Generator().manual_seed(seed)).to(device)


# (name, t_q, t_k, mask?, bias?, causal)
CASES = [
    ("plain", 5, 5, False, False, False),
    ("cross_lengths", 4, 9, False, False, False),
    ("padding", 5, 6, True, False, False),
    ("causal_square", 6, 6, False, False, True),
    ("causal_right_aligned", 3, 8, False, False, True),
    ("causal_single_query", 1, 8, False, False, True),
    ("bias", 5, 6, False, True, False),
    ("padding_and_bias", 5, 6, True, True, False),
    ("causal_and_padding", 6, 6, True, False, True),
    ("causal_right_aligned_padding_bias", 4, 7, True, True, True),
]


def _inputs(t_q, t_k, use_mask, use_bias, h_kv, device, requires_grad=False):
    q, k, v = make_qkv(t_q, t_k, h_kv=h_kv, requires_grad=requires_grad, device=device)
    mask = padding(t_k, device) if use_mask else None
    bias = random_bias(t_q, t_k, device) if use_bias else None
    return q, k, v, mask, bias


@pytest.mark.parametrize("h_kv", [H, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize(("name", "t_q", "t_k", "use_mask", "use_bias", "causal"), CASES,
                         ids=[c[0] for c in CASES])
def test_fused_reference_and_formula_agree(name, t_q, t_k, use_mask, use_bias, causal, h_kv, device):
    torch.manual_seed(0)
    q, k, v, mask, bias = _inputs(t_q, t_k, use_mask, use_bias, h_kv, device)
    kw = dict(mask=mask, bias=bias, causal=causal)

    fused, w_fused = sdpa(q, k, v, impl="fused", **kw)
    ref, w_ref = sdpa(q, k, v, impl="reference", **kw)
    with_w, weights = sdpa(q, k, v, impl="fused", need_weights=True, **kw)
    ref_w, weights_ref = sdpa(q, k, v, impl="reference", need_weights=True,
                                                      **kw)
    expected, expected_w = formula(q, k, v, **kw)

    assert w_fused is None
    assert fused.shape == (B, H, t_q, D_H)
    assert_close(fused, ref)
    assert_close(with_w, ref)
    assert_close(ref_w, ref)
    assert_close(ref, expected)
    assert_close(fused, expected)
    assert weights is not None and weights.shape == (B, H, t_q, t_k)
    assert_close(weights, expected_w)
    assert_close(weights_ref, expected_w)
    # Weights come back only when asked for, whichever path ran.
    assert w_ref is None
    # The output is the weights applied to the values.
    v_full = v.repeat_interleave(H // h_kv, dim=1)
    assert_close(weights @ v_full, ref)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_causal_flag_equals_explicit_causal_mask(impl, device):
    for t_q, t_k in ((6, 6), (2, 7)):
        q, k, v = make_qkv(t_q, t_k, device=device)
        flag, _ = sdpa(q, k, v, causal=True, impl=impl)
        explicit, _ = sdpa(q, k, v, mask=causal_mask(t_q, t_k, device=device), impl=impl)
        assert_close(flag, explicit)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_explicit_scale(impl, device):
    q, k, v = make_qkv(4, 6, device=device)
    mask = padding(6, device)
    out, _ = sdpa(q, k, v, mask=mask, scale=0.37, impl=impl)
    expected, _ = formula(q, k, v, mask=mask, scale=0.37)
    assert_close(out, expected)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_bias_equal_to_mask(impl, device):
    """A -inf additive bias at the masked keys is the same as the bool mask."""
    q, k, v = make_qkv(5, 6, device=device)
    mask = padding(6, device)
    as_bias = torch.zeros(mask.shape, device=device).masked_fill(~mask, float("-inf"))
    out_mask, _ = sdpa(q, k, v, mask=mask, impl=impl)
    out_bias, _ = sdpa(q, k, v, bias=as_bias, impl=impl)
    assert_close(out_mask, out_bias)


def _fully_masked_cases():
    t_q, t_k = 5, 6
    # Per-query mask: query rows 1 and 3 of batch 0 (all heads) and row 0 of batch 2, head 4
    # see no key at all.
    g = torch.Generator().manual_seed(3)
    per_query = torch.rand(B, H, t_q, t_k, generator=g) > 0.4
    per_query[:, :, :, 0] = True  # every other row sees at least key 0
    per_query[0, :, 1] = False
    per_query[0, :, 3] = False
    per_query[2, 4, 0] = False
    # A batch row whose keys are all padding.
    valid = torch.ones(B, t_k, dtype=torch.bool)
    valid[1] = False
    valid[2, -2:] = False
    all_padded = key_mask(valid)
    # Left padding + causal: the first query of batch 0 sees only padded keys.
    valid_left = torch.ones(B, t_k, dtype=torch.bool)
    valid_left[0, :2] = False
    left_padded = key_mask(valid_left)
    return [
        ("per_query", t_q, t_k, per_query, False),
        ("all_padded_batch_row", t_q, t_k, all_padded, False),
        ("left_padding_causal", t_k, t_k, left_padded, True),
        ("left_padding_causal_right_aligned", t_q, t_k, left_padded, True),
    ]


FULLY_MASKED = _fully_masked_cases()


@pytest.mark.parametrize("use_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("h_kv", [H, 2], ids=["mha", "gqa2"])
@pytest.mark.parametrize(("name", "t_q", "t_k", "mask", "causal"), FULLY_MASKED,
                         ids=[c[0] for c in FULLY_MASKED])
def test_fully_masked_rows_are_zero_and_finite(name, t_q, t_k, mask, causal, h_kv, use_bias, device):
    mask = mask.to(device)  # (B, 1 or H, t_q or 1, t_k), built on the CPU at import
    bias = random_bias(t_q, t_k, device) if use_bias else None
    expected, expected_w = formula(*make_qkv(t_q, t_k, h_kv=h_kv, device=device), mask=mask, bias=bias,
                                   causal=causal)
    allowed = mask.expand(B, H, t_q, t_k)
    if causal:
        allowed = allowed & causal_mask(t_q, t_k, device=device)
    dead = ~allowed.any(dim=-1)  # (B, H, t_q) queries with no visible key
    assert dead.any(), "the case must contain at least one fully masked query"

    outputs, grads = {}, {}
    for impl, need_weights in (("fused", False), ("reference", False), ("reference", True)):
        q, k, v = make_qkv(t_q, t_k, h_kv=h_kv, requires_grad=True, device=device)
        out, weights = sdpa(q, k, v, mask=mask, bias=bias, causal=causal,
                                                    impl=impl, need_weights=need_weights)
        assert torch.isfinite(out).all()
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))
        assert_close(out, expected)
        if weights is not None:
            assert torch.isfinite(weights).all()
            assert torch.equal(weights[dead], torch.zeros_like(weights[dead]))
            assert_close(weights, expected_w)
        # Backward through the fully masked rows: finite gradients everywhere.
        (out * torch.linspace(-1.0, 1.0, D_H, device=device)).sum().backward()
        for t in (q, k, v):
            assert t.grad is not None and torch.isfinite(t.grad).all()
        # A dead query contributes nothing, so its gradient is exactly zero.
        assert torch.equal(q.grad[dead], torch.zeros_like(q.grad[dead]))
        outputs[(impl, need_weights)] = out.detach()
        grads[(impl, need_weights)] = (q.grad, k.grad, v.grad)

    assert_close(outputs[("fused", False)], outputs[("reference", False)])
    for a, b in zip(grads[("fused", False)], grads[("reference", False)], strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("h_kv", [H, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize(("name", "t_q", "t_k", "use_mask", "use_bias", "causal"), CASES,
                         ids=[c[0] for c in CASES])
def test_gradients_agree(name, t_q, t_k, use_mask, use_bias, causal, h_kv, device):
    grads = []
    for impl in ("fused", "reference"):
        q, k, v, mask, bias = _inputs(t_q, t_k, use_mask, use_bias, h_kv, device, requires_grad=True)
        out, _ = sdpa(q, k, v, mask=mask, bias=bias, causal=causal,
                                              impl=impl)
        (out * torch.linspace(-1.0, 1.0, D_H, device=device)).sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for a, b in zip(*grads, strict=True):
        assert_close(a, b)

