"""LoRA as aiayn applies it (aiayn.finetune.lora) against PEFT's LoraLayer: the same output and
gradients on the same weights, PEFT's initialisation, merging, freezing, and the CPU kernels."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.testing import assert_close

from aiayn.config import ConfigError
from aiayn.fast import linear, onednn, optimize, plain
from aiayn.finetune.lora import LoraConfig, LoraLinear, apply_lora, lora_state_dict, merge_lora
from aiayn.nn.mlp import FeedForward

peft = pytest.importorskip("peft")


def _randomize_adapters(model, seed=7, scale=0.2):
    """Nonzero B (a fresh adapter's is zero) so every adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_state_dict(model).values():
            p.copy_(scale * torch.randn(p.shape, generator=g))


def test_layer_equals_peft_output_and_gradients():
    torch.manual_seed(0)
    ffn = FeedForward(12, 20, activation="relu")
    theirs = peft.get_peft_model(copy.deepcopy(ffn), peft.LoraConfig(r=4, lora_alpha=6, target_modules=["fc_in", "fc_out"]))
    ours = apply_lora(ffn, LoraConfig(rank=4, alpha=6, targets=("up", "down")))
    _randomize_adapters(ours)
    for name, target in (("fc_in", "up"), ("fc_out", "down")):
        layer = theirs.base_model.model.get_submodule(name)
        with torch.no_grad():
            layer.lora_A["default"].weight.copy_(getattr(ours, name).lora_A[target])
            layer.lora_B["default"].weight.copy_(getattr(ours, name).lora_B[target])
    x = torch.randn(3, 5, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    out, expected = ours(x), theirs(x2)
    assert_close(out, expected)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    assert_close(x.grad, x2.grad)
    for name, target in (("fc_in", "up"), ("fc_out", "down")):
        layer = theirs.base_model.model.get_submodule(name)
        assert_close(getattr(ours, name).lora_A[target].grad, layer.lora_A["default"].weight.grad)
        assert_close(getattr(ours, name).lora_B[target].grad, layer.lora_B["default"].weight.grad)


def test_init_is_peft_s():
    """A: kaiming-uniform with a = sqrt(5), i.e. uniform within 1/sqrt(in); B: zeros (no change at first)."""
    ffn = apply_lora(FeedForward(64, 32, activation="relu"), LoraConfig(rank=8, targets=("up",)))
    a, b = ffn.fc_in.lora_A["up"], ffn.fc_in.lora_B["up"]
    bound = 1 / math.sqrt(64)
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and a.std() > 0.4 * bound
    assert not b.any()


def test_only_adapters_train(tiny_llama, tokens):
    model = apply_lora(copy.deepcopy(tiny_llama[2]), LoraConfig(targets=("q", "k", "v", "o", "gate", "up", "down")))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model)) and trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    model(tokens).logits.sum().backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "k", "v", "o", "gate", "up", "down")])
def test_merged_equals_unmerged(tiny_llama, tokens, targets):
    model = apply_lora(copy.deepcopy(tiny_llama[2]), LoraConfig(rank=4, alpha=8, targets=targets))
    _randomize_adapters(model)
    with torch.no_grad():
        before = model(tokens).logits
        assert not torch.allclose(before, tiny_llama[2](tokens).logits)
        merged = merge_lora(model)
        assert not any(isinstance(m, LoraLinear) for m in merged.modules())
        assert_close(merged(tokens).logits, before)
        assert set(merged.state_dict()) == set(tiny_llama[2].state_dict())


def test_fast_kernels_equal_plain(tiny_gpt2, tokens):
    """aiayn.fast keeps the adapted projections LoraLinear (only their frozen product's kernel changes) and
    swaps the rest."""
    model = apply_lora(copy.deepcopy(tiny_gpt2[2]), LoraConfig(targets=("qkv", "down")))
    _randomize_adapters(model)
    with torch.no_grad():
        expected = model(tokens).logits
        optimize(model)
        assert type(model.decoder.blocks[0].self_attn.out_proj).__name__ == "FastLinear"
        assert isinstance(model.decoder.blocks[0].self_attn.qkv_proj, LoraLinear)
        assert_close(model(tokens).logits, expected)
        plain(model)


@pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear op")
def test_fast_frozen_product_asks_no_weight_gradient(monkeypatch):
    """Optimized, an adapted projection's frozen product runs on the oneDNN kernel with the plain layer's
    output and gradients, and its backward never computes the frozen weight's gradient."""
    torch.manual_seed(0)
    ffn = apply_lora(FeedForward(256, 512, activation="swiglu"), LoraConfig(rank=4, alpha=8, targets=("gate", "down")))
    _randomize_adapters(ffn, scale=0.05)  # 128 rows x 512 x 256: oneDNN's smallest product (MIN_WORK)
    fast = optimize(copy.deepcopy(ffn), "train")
    assert fast.fc_in.base_kernel is linear.fast_linear
    x, weights = torch.randn(2, 64, 256), torch.randn(2, 64, 256)
    results = []
    for model in (ffn, fast):
        if model is fast:
            kernels, backwards, weight_grads = (_calls(monkeypatch, module, name) for module, name in (
                (linear, "onednn_linear"), (onednn, "_linear_backward_op"), (onednn, "weight_gradient")))
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        (out * weights).sum().backward()
        results.append([out, xi.grad, *(p.grad for p in lora_state_dict(model).values())])
    for got, expected in zip(results[1], results[0], strict=True):
        assert_close(got, expected)
    assert len(kernels) == 2 and len(backwards) == 2 and not weight_grads
    assert [call[4] for call in backwards] == [False, False]  # need_weight
    assert fast.fc_in.weight.grad is None and fast.fc_out.weight.grad is None


def _calls(monkeypatch, module, name):
    """The positional arguments of each call of ``module.name`` from now on (it still runs)."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_targets_are_checked(tiny_gpt2, tiny_llama):
    with pytest.raises(ConfigError, match=r"lora target\(s\) gate match no projection of this model; it has q, k, v, qkv, o, up, down"):
        apply_lora(copy.deepcopy(tiny_gpt2[2]), LoraConfig(targets=("gate",)))
    with pytest.raises(ConfigError, match="overlap"):
        apply_lora(copy.deepcopy(tiny_llama[2]), LoraConfig(targets=("qkv", "q")))
    with pytest.raises(ConfigError, match="unknown"):
        LoraConfig(targets=("query",))
    assert LoraConfig.from_dict({"rank": 2, "targets": "q, v"}).targets == ("q", "v")
    model = apply_lora(copy.deepcopy(tiny_llama[2]), LoraConfig())
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraConfig())
