"""aiayn ``MultiHeadAttention`` equals ``torch.nn.MultiheadAttention`` with the same weights.

Weight mapping (torch -> aiayn):
  self-attention:  in_proj_weight / in_proj_bias (q rows, k rows, v rows) -> qkv_proj
  cross-attention: the q rows -> q_proj, the k and v rows -> kv_proj (k rows, then v rows)
  out_proj -> out_proj
Mask conversion: torch's key_padding_mask and bool attn_mask say True = *not* allowed; aiayn's
mask says True = may attend, so ours = ~torch's (key padding reshaped to (b, 1, 1, s)).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from aiayn.nn.attention import AttentionInputs, MultiHeadAttention
from aiayn.nn.masks import key_mask

D, H = 48, 6
B, T, S = 3, 5, 9  # batch, query length, source length of cross-attention
IMPLS = ["fused", "reference"]


def make_pair(*, cross: bool, impl: str, device: torch.device, seed: int = 0):
    """A torch MHA with random weights and biases, and an aiayn MHA holding the same weights, both
    built on the CPU (the same numbers everywhere) and moved to ``device``."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(D, H, dropout=0.0, bias=True, batch_first=True)
    with torch.no_grad():  # nonzero biases so that a misplaced bias is noticed
        ref.in_proj_bias.normal_(0.0, 0.5)
        ref.out_proj.bias.normal_(0.0, 0.5)
    ours = MultiHeadAttention(D, H, cross=cross, bias=True, impl=impl)
    with torch.no_grad():
        w, b = ref.in_proj_weight, ref.in_proj_bias
        if cross:
            ours.q_proj.weight.copy_(w[:D])
            ours.q_proj.bias.copy_(b[:D])
            ours.kv_proj.weight.copy_(w[D:])
            ours.kv_proj.bias.copy_(b[D:])
        else:
            ours.qkv_proj.weight.copy_(w)
            ours.qkv_proj.bias.copy_(b)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)
    return ref.to(device).eval(), ours.to(device).eval()


def inputs(*, cross: bool, device: torch.device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).to(device)
    memory = torch.randn(B, S, D, generator=g).to(device) if cross else None
    return x, memory


def torch_key_padding(k_len: int) -> torch.Tensor:
    """torch convention (True = padding): batch 0 unpadded, 1 has one trailing pad, 2 has three.
    Key 0 is always real, so no query row is fully masked even under a causal mask."""
    kpm = torch.zeros(B, k_len, dtype=torch.bool)
    kpm[1, -1:] = True
    kpm[2, -3:] = True
    return kpm


def torch_attn_mask(cross: bool) -> torch.Tensor:
    """torch bool attn_mask (True = not allowed): causal for self-attention, a random pattern
    with key 0 always visible for cross-attention."""
    if not cross:
        return torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    g = torch.Generator().manual_seed(7)
    blocked = torch.rand(T, S, generator=g) < 0.5
    blocked[:, 0] = False
    return blocked


MASK_CASES = ["none", "key_padding", "attn_mask", "both"]


def build_masks(case: str, cross: bool, device: torch.device):
    """-> (torch kwargs, our mask), on ``device``"""
    k_len = S if cross else T
    torch_kw, ours = {}, None
    if case in ("key_padding", "both"):
        kpm = torch_key_padding(k_len)
        torch_kw["key_padding_mask"] = kpm
        ours = key_mask(~kpm)  # (b, 1, 1, k_len)
    if case in ("attn_mask", "both"):
        am = torch_attn_mask(cross)
        torch_kw["attn_mask"] = am
        converted = ~am[None, None]  # (1, 1, t, k_len)
        ours = converted if ours is None else ours & converted
    return {k: v.to(device) for k, v in torch_kw.items()}, None if ours is None else ours.to(device)


def run_torch(ref, x, memory, need_weights=False, average=True, **kw):
    kv = x if memory is None else memory
    return ref(x, kv, kv, need_weights=need_weights, average_attn_weights=average, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_output_matches_torch(cross, case, impl, device):
    ref, ours = make_pair(cross=cross, impl=impl, device=device)
    x, memory = inputs(cross=cross, device=device)
    torch_kw, mask = build_masks(case, cross, device)
    with torch.no_grad():
        expected, _ = run_torch(ref, x, memory, need_weights=False, **torch_kw)
        got, weights = ours(x, memory, inputs=AttentionInputs(mask=mask))
    assert weights is None
    assert got.shape == (B, T, D)
    assert_close(got, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_weights_match_torch(cross, case, impl, device):
    ref, ours = make_pair(cross=cross, impl=impl, device=device)
    x, memory = inputs(cross=cross, device=device)
    torch_kw, mask = build_masks(case, cross, device)
    k_len = S if cross else T
    with torch.no_grad():
        exp_out, exp_avg = run_torch(ref, x, memory, need_weights=True, average=True, **torch_kw)
        _, exp_heads = run_torch(ref, x, memory, need_weights=True, average=False, **torch_kw)
        got, weights = ours(x, memory, inputs=AttentionInputs(mask=mask), need_weights=True)
    assert weights is not None and weights.shape == (B, H, T, k_len)
    assert exp_heads.shape == (B, H, T, k_len)
    assert_close(got, exp_out)
    assert_close(weights, exp_heads)
    assert_close(weights.mean(1), exp_avg)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_padding", [False, True], ids=["causal", "causal_and_padding"])
def test_causal_flag_matches_torch_causal_attn_mask(with_padding, impl, device):
    """Our causal=True (no materialised mask) equals torch with the causal bool attn_mask."""
    ref, ours = make_pair(cross=False, impl=impl, device=device)
    x, _ = inputs(cross=False, device=device)
    torch_kw = {"attn_mask": torch_attn_mask(cross=False).to(device)}
    mask = None
    if with_padding:
        kpm = torch_key_padding(T).to(device)
        torch_kw["key_padding_mask"] = kpm
        mask = key_mask(~kpm)
    with torch.no_grad():
        expected, exp_heads = run_torch(ref, x, None, need_weights=True, average=False, **torch_kw)
        got, _ = ours(x, inputs=AttentionInputs(mask=mask, causal=True))
        got_w, weights = ours(x, inputs=AttentionInputs(mask=mask, causal=True), need_weights=True)
    assert_close(got, expected)
    assert_close(got_w, expected)
    assert_close(weights, exp_heads)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_gradients_match_torch(cross, impl, device):
    """Same loss, same gradients with respect to the inputs and every projection."""
    ref, ours = make_pair(cross=cross, impl=impl, device=device)
    x, memory = inputs(cross=cross, device=device)
    torch_kw, mask = build_masks("both", cross, device)
    x_ref, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    m_ref = m_ours = None
    if cross:
        m_ref, m_ours = memory.clone().requires_grad_(True), memory.clone().requires_grad_(True)
    w = torch.randn(B, T, D, generator=torch.Generator().manual_seed(5)).to(device)
    out_ref, _ = run_torch(ref, x_ref, m_ref, need_weights=False, **torch_kw)
    out_ours, _ = ours(x_ours, m_ours, inputs=AttentionInputs(mask=mask))
    (out_ref * w).sum().backward()
    (out_ours * w).sum().backward()

    assert_close(x_ours.grad, x_ref.grad)
    if cross:
        assert_close(m_ours.grad, m_ref.grad)
        in_w = torch.cat([ours.q_proj.weight.grad, ours.kv_proj.weight.grad])
        in_b = torch.cat([ours.q_proj.bias.grad, ours.kv_proj.bias.grad])
    else:
        in_w, in_b = ours.qkv_proj.weight.grad, ours.qkv_proj.bias.grad
    assert_close(in_w, ref.in_proj_weight.grad)
    assert_close(in_b, ref.in_proj_bias.grad)
    assert_close(ours.out_proj.weight.grad, ref.out_proj.weight.grad)
    assert_close(ours.out_proj.bias.grad, ref.out_proj.bias.grad)
