"""Additive attention (aiayn/nn/additive.py) against the formula written as loops, with the
library's mask conventions; plugged into a model it trains (its w gets gradients)."""

from __future__ import annotations

import pytest
import torch

from aiayn.models import build_model, get_preset
from aiayn.nn.additive import AdditiveAttentionKernel, additive_attention, use_additive_attention


def loops(q, k, v, w, mask=None):
    b, h, t_q, _ = q.shape
    out = torch.zeros_like(q)
    for i in range(b):
        for j in range(h):
            for s in range(t_q):
                scores = torch.stack([w[j] @ torch.tanh(q[i, j, s] + k[i, j, r]) for r in range(k.shape[2])])
                if mask is not None:
                    scores = scores.masked_fill(~mask[i, 0, s], float("-inf"))
                out[i, j, s] = torch.softmax(scores, -1) @ v[i, j]
    return out


def test_equals_the_formula_with_and_without_a_mask():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, t, 4, generator=gen, dtype=torch.float64) for t in (5, 6, 6))
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(additive_attention(q, k, v, w)[0], loops(q, k, v, w))
    mask = torch.rand(2, 1, 5, 6, generator=gen) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(additive_attention(q, k, v, w, mask=mask)[0], loops(q, k, v, w, mask))
    # 3-D masks are per batch element, like the dot-product function's
    torch.testing.assert_close(additive_attention(q, k, v, w, mask=mask[:, 0])[0], loops(q, k, v, w, mask))


def test_causal_gqa_and_a_query_that_sees_nothing():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 5, 8, generator=gen)
    k, v = torch.randn(2, 1, 2, 5, 8, generator=gen)
    w = torch.randn(4, 8, generator=gen)
    out, weights = additive_attention(q, k, v, w, causal=True, need_weights=True)
    assert weights is not None and torch.equal(weights.triu(1), torch.zeros_like(weights))
    torch.testing.assert_close(out, additive_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), w,
                                                       causal=True)[0])
    hidden = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    out, weights = additive_attention(q, k, v, w, mask=hidden, need_weights=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(weights, torch.zeros_like(weights))
    with pytest.raises(ValueError, match=r"w must be \(heads, head_dim\) = \(4, 8\)"):
        additive_attention(q, k, v, w[:2])


def test_a_model_with_additive_attention_trains_its_w():
    torch.manual_seed(0)
    model = use_additive_attention(build_model(get_preset("tiny")))
    kernels = [m for m in model.modules() if isinstance(m, AdditiveAttentionKernel)]
    assert len(kernels) == 2 + 2 * 2  # encoder self; decoder self and cross
    src, tgt = torch.randint(3, 99, (2, 7)), torch.randint(3, 99, (2, 5))
    model(src, tgt).logits.sum().backward()
    assert all(kernel.w.grad is not None and kernel.w.grad.abs().sum() > 0 for kernel in kernels)
