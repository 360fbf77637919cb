"""GPT-2 loaded through ``aiayn.interop.load_hf`` equals Hugging Face's GPT2LMHeadModel: logits
(plain and left-padded), 20-token greedy generations with and without the KV cache, the export
round trip, and old-style checkpoints (no ``transformer.`` prefix, causal-mask buffers).

Cases: ``gpt2`` (gelu_new, output tied to wte, d_ff 4 d) and ``gpt2-untied`` (erf GELU, untied
output, d_ff 37). Conv1D weights are stored (in, out): a missed transpose fails every test.
"""

from __future__ import annotations

import shutil

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
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from aiayn.interop import from_hf_model, load_hf

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=VOCAB, n_embd=48, n_head=6, n_layer=2, n_positions=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    "gpt2": {},
    "gpt2-untied": dict(n_inner=37, activation_function="gelu", tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, device):
    """(name, HF model, its directory, aiayn model, aiayn config); both models on ``device``."""
    hf_config = transformers.GPT2Config(**BASE, **CASES[request.param])
    return converted_case(request.param, transformers.GPT2LMHeadModel, hf_config, tmp_path_factory, device)


def test_config_is_converted(case):
    name, _, _, _, config = case
    assert (config.arch, config.positional, config.norm, config.norm_position) == (
        "decoder-only", "learned", "layernorm", "pre")
    assert config.activation == ("gelu_tanh" if name == "gpt2" else "gelu")
    assert config.d_ff == (192 if name == "gpt2" else 37)
    assert config.tie_output == (name == "gpt2")


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
    _, hf, _, model, config = case
    assert check_decoder_export(hf, model, config, tmp_path / "exported") == "gpt2"


@torch.no_grad()
def test_old_checkpoint_names_and_mask_buffers(case, tmp_path, device):
    """The original gpt2 checkpoints: names without ``transformer.``, plus ``attn.bias`` (causal
    mask) and ``attn.masked_bias`` buffers, which are not weights."""
    _, _, path, model, _ = case
    old = {k.removeprefix("transformer."): v for k, v in load_file(f"{path}/model.safetensors").items()}
    for i in range(2):
        old[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64))[None, None]
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, _ = load_hf(tmp_path)
    loaded = loaded.to(device)
    tokens = random_tokens((2, 7), seed=7, device=device)
    assert_close(loaded(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def test_batched_generation_equals_one_by_one(case):
    """Left-padded batches through generate_decoder_only / greedy_decoder_only: each row's tokens
    are those it gets alone."""
    check_batched_generation(case[3])
