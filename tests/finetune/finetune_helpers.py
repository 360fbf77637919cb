"""Tiny inputs of the fine-tuning tests: a text of random words, and random Hugging Face models (LLaMA,
GPT-2) saved with ``save_pretrained`` beside a byte-level BPE trained on that text."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar in a test's captured output

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "cats", "sit", "on", "warm", "mats", "and", "sing"]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def write_text(path: Path, lines: int = 120, seed: int = 0) -> Path:
    """``lines`` lines of eight random words."""
    rng = random.Random(seed)
    path.write_text("".join(" ".join(rng.choice(WORDS) for _ in range(8)) + "\n" for _ in range(lines)),
                    encoding="utf-8")
    return path


def bpe_tokenizer(text: str, vocab_size: int = 300):
    """A byte-level BPE of ``vocab_size`` tokens trained on ``text``, the end-of-text token at id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return tok


def tiny_hf_model(kind: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer LLaMA (GQA) or GPT-2 (no dropout), float32, its output untied."""
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=None)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=32, n_head=4, n_layer=2, n_positions=128,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def save_hf_dir(directory: Path, kind: str, text: str, seed: int = 0) -> Path:
    """A Hugging Face model directory: the model (``save_pretrained``), tokenizer.json and a
    tokenizer_config.json with the end-of-text token and a chat template."""
    tok = bpe_tokenizer(text)
    model = tiny_hf_model(kind, tok.get_vocab_size(), seed)
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": CHAT_TEMPLATE}),
                                                     encoding="utf-8")
    return directory
