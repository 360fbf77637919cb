"""A 3-D mask or bias is (batch, q_len, k_len), the same for every head: never read as
(heads, q_len, k_len), even when batch == heads, in every place that consumes one — the attention
function (both paths, with causal masking on top), aiayn.fast's kernel and MultiHeadAttention."""

from __future__ import annotations

import pytest
import torch

from aiayn.fast.attention import fast_attention
from aiayn.nn.attention import AttentionInputs, MultiHeadAttention, scaled_dot_product_attention
from aiayn.nn.masks import scores_shaped

B = H = 3  # batch == heads: the case plain broadcasting gets wrong without a word
T_Q, T_K, D_H = 4, 5, 8


def qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, t, D_H, generator=gen) for t in (T_Q, T_K, T_K))  # type: ignore[return-value]


def per_example_masks() -> torch.Tensor:
    """(b, t_q, t_k): each batch element hides different keys; element 1 leaves query 0 no key."""
    mask = torch.ones(B, T_Q, T_K, dtype=torch.bool)
    mask[0, :, 3:] = False
    mask[1, 0, :] = False
    mask[2, :, :2] = False
    return mask


def one_by_one(q, k, v, mask, **kw) -> torch.Tensor:
    """Each batch element alone with its own 2-D mask: the meaning a 3-D mask must have."""
    return torch.cat([scaled_dot_product_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], mask=mask[i],
                                                   need_weights=True, **kw)[0] for i in range(B)])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("path", ["reference", "fused", "fast"])
def test_a_3d_mask_is_per_batch_element_and_shared_by_heads(path, causal):
    q, k, v = qkv()
    mask = per_example_masks()
    expected = one_by_one(q, k, v, mask, causal=causal)
    if path == "fast":
        got = fast_attention(q, k, v, mask=mask, causal=causal)[0]
    else:
        got = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal, need_weights=path == "reference")[0]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, scaled_dot_product_attention(q, k, v, mask=mask[:, None], causal=causal)[0])
    # and not what broadcasting (h, t_q, t_k) would give
    wrong = scaled_dot_product_attention(q, k, v, mask=mask[None], causal=causal)[0]
    assert not torch.allclose(got, wrong)
    assert torch.equal(got[1, :, 0], torch.zeros(H, D_H)) and got[0, :, 0].abs().sum() > 0


def test_the_weights_follow_the_same_rows():
    q, k, v = qkv(1)
    mask = per_example_masks()
    _, weights = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=True)
    assert weights is not None
    assert torch.equal(weights[0, :, :, 3:], torch.zeros(H, T_Q, 2))  # element 0 hides keys 3, 4 in every head
    assert torch.equal(weights[2, :, :, :2], torch.zeros(H, T_Q, 2))
    torch.testing.assert_close(weights[1, :, 1:].sum(-1), torch.ones(H, T_Q - 1))
    assert torch.equal(weights[1, :, 0], torch.zeros(H, T_K))


def test_a_3d_bias_is_per_batch_element_too():
    q, k, v = qkv(2)
    bias = torch.randn(B, T_Q, T_K)
    got = scaled_dot_product_attention(q, k, v, bias=bias)[0]
    torch.testing.assert_close(got, scaled_dot_product_attention(q, k, v, bias=bias[:, None])[0])
    torch.testing.assert_close(got, fast_attention(q, k, v, bias=bias)[0])
    assert scores_shaped(bias).shape == (B, 1, T_Q, T_K) and scores_shaped(bias[0]).shape == (T_Q, T_K)


def test_multi_head_attention_reads_a_3d_mask_per_batch_element():
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=H * D_H, n_heads=H).eval()
    x = torch.randn(B, T_K, H * D_H)
    mask = torch.rand(B, T_K, T_K) > 0.3
    got = mha(x, inputs=AttentionInputs(mask=mask))[0]
    for i in range(B):
        torch.testing.assert_close(got[i], mha(x[i : i + 1], inputs=AttentionInputs(mask=mask[i]))[0][0])


@pytest.mark.parametrize("what", ["mask", "bias"])
def test_a_3d_mask_that_does_not_fit_the_batch_is_refused(what):
    """(heads, t_q, t_k) for one example is not (batch, t_q, t_k): refused, with the way out."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, t, D_H, generator=gen) for t in (T_Q, T_K, T_K))
    per_head = torch.ones(H, T_Q, T_K, dtype=torch.bool) if what == "mask" else torch.zeros(H, T_Q, T_K)
    with pytest.raises(ValueError, match=rf"a 3-D {what} is \(batch, q_len, k_len\), the same for every head; "
                                         rf"shape \(3, 4, 5\) does not fit batch 1.*give 4 dimensions"):
        scaled_dot_product_attention(q, k, v, **{what: per_head})
    with pytest.raises(ValueError, match=f"a 3-D {what} is"):
        fast_attention(q, k, v, **{what: per_head})
    # the 4-D spelling of a per-head mask is accepted
    scaled_dot_product_attention(q, k, v, **{what: per_head[None]})
