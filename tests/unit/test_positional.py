"""Positional schemes: the paper's formula, the relative-position property, RoPE, ALiBi, T5."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from aiayn.nn.positional import (
    ALiBi,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    T5RelativeBias,
    apply_rotary,
    sinusoidal_encoding,
)


def test_sinusoidal_matches_the_paper_formula():
    d = 48
    pe = sinusoidal_encoding(torch.arange(60), d)
    for pos in (0, 1, 7, 59):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert math.isclose(pe[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-5)
            assert math.isclose(pe[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-5)


def test_sinusoidal_dot_product_depends_only_on_offset():
    """PE(t)·PE(t+k) = sum_i cos(k w_i): the same for every t (the seeds' proof)."""
    d = 64
    pe = sinusoidal_encoding(torch.arange(300, dtype=torch.float64), d).double()
    for k in (1, 2, 5, 17, 40):
        dots = (pe[: 300 - k] * pe[k:]).sum(-1)  # PE(t)·PE(t+k) for all t
        i = torch.arange(0, d, 2, dtype=torch.float64)
        expected = torch.cos(k / 10000 ** (i / d)).sum()
        assert_close(dots, expected.expand_as(dots), rtol=1e-4, atol=1e-4)
        assert dots.std() < 1e-4
    # and it differs between offsets (so it really encodes the distance)
    assert (pe[0] @ pe[1]) > (pe[0] @ pe[10]) > (pe[0] @ pe[40]) - 10


def test_sinusoidal_module_and_too_long_positions():
    module = SinusoidalPositionalEncoding(16, max_len=10)
    assert_close(module(torch.arange(10)[None]), sinusoidal_encoding(torch.arange(10), 16)[None])
    with pytest.raises(ValueError, match="position 10 is beyond the model's maximum"):
        module(torch.arange(11)[None])


def test_rope_relative_property_and_norm():
    """<R(m) q, R(n) k> depends only on m - n, and rotation keeps vector norms."""
    rope = RotaryEmbedding(8, max_len=64)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def rotated(x, pos):
        cos, sin = rope(torch.tensor([[pos]]))
        return apply_rotary(x, cos, sin)

    for m, n in ((5, 2), (20, 17), (40, 37)):
        score = (rotated(q, m) * rotated(k, n)).sum()
        assert_close(score, (rotated(q, 3) * rotated(k, 0)).sum())
    assert_close(rotated(q, 11).norm(), q.norm())


def test_alibi_slopes_and_bias():
    assert_close(ALiBi.make_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    assert ALiBi.make_slopes(6).shape == (6,)
    bias = ALiBi(4)(torch.arange(5)[None], torch.arange(5)[None])
    assert bias.shape == (1, 4, 5, 5)
    assert_close(bias[0, 0, 4, 1], torch.tensor(-0.25 * 3))
    assert torch.all(bias[0, :, 2, 2] == 0)


def test_t5_buckets():
    bucket = T5RelativeBias.bucket
    rel = torch.arange(-200, 201)
    bi = bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)
    assert bi.min() >= 0 and bi.max() < 32
    assert bi[200] == 0  # distance 0
    assert torch.equal(bi[200 + 1 : 200 + 8], torch.arange(17, 24))  # exact small positive distances
    assert bi[0] == bi[1] == 15  # far past saturates
    uni = bucket(rel, bidirectional=False, num_buckets=32, max_distance=128)
    assert torch.all(uni[201:] == 0)  # the future is one bucket in causal attention
    assert uni.max() == 31
    bias = T5RelativeBias(6, bidirectional=True)(torch.arange(4)[None], torch.arange(4)[None])
    assert bias.shape == (1, 6, 4, 4)
