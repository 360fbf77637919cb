"""LLaMA-family decoders (LLaMA, Mistral, Qwen2) loaded through ``aiayn.interop.load_hf`` equal
Hugging Face: logits (plain and left-padded), 20-token greedy generations with and without the
KV cache, and the export round trip. Float32, default tolerances.

Each case has odd tiny sizes (d 48, 6 query heads sharing 2 kv heads, d_ff 37, vocab 99):
``llama`` with a non-default rope_theta and untied output; ``llama-bias`` with attention and MLP
biases, tied output and head_dim 12 != d / h; ``mistral``; ``qwen2`` (q/k/v biases, no o_proj bias).
"""

from __future__ import annotations

import pytest
import torch
from hf_helpers import (
    VOCAB,
    check_batched_generation,
    check_decoder_export,
    check_decoder_generation,
    check_decoder_left_padding,
    check_decoder_logits,
    converted_case,
    random_tokens,
)
from torch.testing import assert_close

from aiayn.interop import from_hf_model

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
            num_hidden_layers=2, intermediate_size=37, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM",
                   dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=12)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=64)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}
EXPORTED_TYPE = {"llama": "llama", "llama-bias": "llama", "mistral": "llama", "qwen2": "qwen2"}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, device):
    """(name, HF model, its directory, aiayn model, aiayn config); both models on ``device``."""
    config_cls, model_cls, extra = CASES[request.param]
    hf_config = getattr(transformers, config_cls)(**BASE, **extra)
    return converted_case(request.param, getattr(transformers, model_cls), hf_config, tmp_path_factory, device)


def test_config_is_converted(case):
    name, hf, _, _, config = case
    assert (config.arch, config.positional, config.norm, config.activation) == (
        "decoder-only", "rope", "rmsnorm", "swiglu")
    assert (config.n_heads, config.n_kv_heads, config.d_ff) == (6, 2, 37)
    assert config.attn_bias == (name in ("llama-bias", "qwen2"))
    assert config.attn_out_bias == config.mlp_bias == (name == "llama-bias")
    assert config.head_dim == (12 if name == "llama-bias" else 8)
    assert config.rope_base == (500000.0 if name == "llama" else 10000.0)
    assert config.tie_output == hf.config.tie_word_embeddings


def test_logits_match(case):
    check_decoder_logits(case[1], case[3])


def test_left_padded_batch_matches(case):
    check_decoder_left_padding(case[1], case[3])


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "recompute"])
def test_greedy_generation_matches(case, use_cache):
    check_decoder_generation(case[1], case[3], use_cache=use_cache)


@torch.no_grad()
def test_from_hf_model_equals_load_hf(case, device):
    _, hf, _, model, _ = case
    converted, _ = from_hf_model(hf)  # built on the CPU, as load_hf's model is
    converted = converted.to(device)
    tokens = random_tokens((2, 7), seed=5, device=device)
    assert_close(converted(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def test_export_round_trip(case, tmp_path):
    name, hf, _, model, config = case
    assert check_decoder_export(hf, model, config, tmp_path / "exported") == EXPORTED_TYPE[name]


def test_batched_generation_equals_one_by_one(case):
    """Left-padded batches through generate_decoder_only / greedy_decoder_only: each row's tokens
    are those it gets alone."""
    check_batched_generation(case[3])
