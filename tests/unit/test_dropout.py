"""aiayn.fast.dropout: the faster CPU mask drops with the right probability, scales the rest,
back-propagates through the same mask, follows torch's seed, and is used by the models."""

from __future__ import annotations

import pytest
import torch

from aiayn.fast import optimize
from aiayn.fast.attention import fast_attention
from aiayn.fast.dropout import FastDropout, dropout, keep_mask
from aiayn.models import build_model, get_preset
from aiayn.nn.attention import scaled_dot_product_attention


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_keep_fraction_matches_p(p):
    torch.manual_seed(0)
    n = 1_000_000
    kept = keep_mask((n,), p).float().mean().item()
    # binomial standard deviation sqrt(p (1 - p) / n) <= 5e-4; allow 5 of them
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5 + 1 / 65536


def test_mask_elements_are_independent_of_their_neighbours():
    """Four elements share one 64-bit draw; their keep decisions must still be independent."""
    torch.manual_seed(1)
    mask = keep_mask((250_000, 4), 0.5).float()
    both = (mask[:, 0] * mask[:, 1]).mean().item()
    assert abs(both - 0.25) < 0.005
    assert abs(mask[1:, 0].mul(mask[:-1, 3]).mean().item() - 0.25) < 0.005


def test_values_gradient_and_seed():
    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = dropout(x, 0.25)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, kept.double() / 0.75)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.25), y)  # the global generator decides the mask


def test_identity_in_eval_and_edges():
    x = torch.randn(4, 6)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dropout(x, 1.5)
    module = FastDropout(0.4)
    assert isinstance(module, torch.nn.Dropout)
    assert module.eval()(x) is x


def test_fast_attention_dropout_is_the_equation_with_this_mask():
    """With dropout on the weights, the fast kernel is equation (1) with this module's mask on the
    weights: the same numbers as dropping the plain function's weights under the same seed."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    _, weights = scaled_dot_product_attention(q, k, v, causal=True, need_weights=True)
    torch.manual_seed(7)
    expected = dropout(weights, 0.2) @ v
    torch.manual_seed(7)
    got, _ = fast_attention(q, k, v, causal=True, dropout_p=0.2)
    torch.testing.assert_close(got, expected)
    assert not torch.equal(got, scaled_dot_product_attention(q, k, v, causal=True)[0])  # it dropped


def test_the_converter_swaps_it_in_and_out():
    from aiayn.fast import plain

    model = build_model(get_preset("tiny"))
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and not any(isinstance(m, FastDropout) for m in drops)  # the plain model: nn.Dropout
    optimize(model, mode="train")
    assert all(type(m) is FastDropout for m in drops)
    plain(model)
    assert all(type(m) is torch.nn.Dropout for m in drops)
