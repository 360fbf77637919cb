"""Restricted (sliding-window) attention: the banded computation equals full attention under
sliding_window_mask, causal or not, at every radius (0, inside, beyond the sequence)."""

from __future__ import annotations

import pytest
import torch

from aiayn.nn.attention import scaled_dot_product_attention
from aiayn.nn.local_attention import local_attention
from aiayn.nn.masks import causal_mask, sliding_window_mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("radius", [0, 1, 3, 20])
def test_banded_equals_masked_full_attention(radius, causal):
    gen = torch.Generator().manual_seed(radius)
    q, k, v = (torch.randn(2, 3, 9, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = sliding_window_mask(9, radius=radius, causal=causal)
    expected = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=True)[0]
    torch.testing.assert_close(local_attention(q, k, v, radius=radius, causal=causal), expected)


def test_the_mask():
    mask = sliding_window_mask(5, radius=1)[0, 0]
    assert mask.sum(-1).tolist() == [2, 3, 3, 3, 2]
    assert torch.equal(sliding_window_mask(5, radius=10, causal=True), causal_mask(5))
    assert sliding_window_mask(2, 6, radius=1)[0, 0].tolist() == [[False, False, False, True, True, True],
                                                                  [False, False, False, False, True, True]]
    with pytest.raises(ValueError, match="radius >= 0"):
        sliding_window_mask(3, radius=-1)
    with pytest.raises(ValueError, match="share one"):
        local_attention(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), radius=1)
