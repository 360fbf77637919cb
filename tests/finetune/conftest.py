"""Fixtures of the fine-tuning tests: tiny random Hugging Face decoders for the LoRA tests (a LLaMA
with grouped-query attention and SwiGLU, a GPT-2 with its fused c_attn, saved with
``save_pretrained`` and loaded into aiayn with ``load_hf``), a small text file and tiny model
directories for the training tests."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from finetune_helpers import save_hf_dir, write_text
from torch import nn

from aiayn.interop import load_hf

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers")
VOCAB = 61


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Weights large enough that a wrong row or transpose shows (N(0, 1/fan_in) matrices)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = model.get_submodule(name.rpartition(".")[0])
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 2 and not isinstance(owner, nn.Embedding):
                fan_in = p.shape[0] if type(owner).__name__ == "Conv1D" else p.shape[1]
                p.copy_(noise / math.sqrt(fan_in))
            elif p.dim() == 2:
                p.copy_(0.5 * noise)
            else:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
    return model.eval()


def _saved(name: str, hf_model: nn.Module, tmp_path_factory) -> tuple:
    """Saved with a word-level tokenizer (words w0 ... w60), so the text commands can run it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    model, config = load_hf(path)
    return hf_model, path, model, config


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(HF LlamaForCausalLM, its directory, aiayn model, aiayn config)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, intermediate_size=40,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return _saved("llama", _randomize(transformers.LlamaForCausalLM(config), 1), tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """(HF GPT2LMHeadModel, its directory, aiayn model, aiayn config)."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return _saved("gpt2", _randomize(transformers.GPT2LMHeadModel(config), 2), tmp_path_factory)


@pytest.fixture
def tokens():
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    return write_text(tmp_path / "text.txt")


@pytest.fixture
def hf_dir(tmp_path: Path, text_file: Path) -> Callable[[str], Path]:
    """``hf_dir("llama" | "gpt2")``: a tiny random model of that family saved in tmp_path."""
    def make(kind: str) -> Path:
        return save_hf_dir(tmp_path / f"hf-{kind}", kind, text_file.read_text(encoding="utf-8"))
    return make
