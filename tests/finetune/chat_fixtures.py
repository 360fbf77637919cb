"""A tiny random chat model for the fine-tuning tests (imported as ``chat_fixtures``): a 2-layer
LLaMA of width 32 saved as a Hugging Face directory with a byte-level BPE (``tokenizer_helpers``)
and the ChatML template SmolLM2 uses, and conversations in OpenAI's fine-tuning JSONL."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizer_helpers import CHAT_TEMPLATE, SPECIALS, train_tokenizer

from aiayn.finetune.source import Source
from aiayn.tasks.sources import load_source

TEXT = ("user assistant system Hello there, how are you? I am fine, thank you. What is two plus two? "
        "It is four. Name a colour. Blue. ") * 20
END_OF_TURN = SPECIALS.index("<|im_end|>")


def conversation(question: str, answer: str, *, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": [*messages, {"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]}


CONVERSATIONS = [conversation("What is two plus two?", "It is four."),
                 conversation("Name a colour.", "Blue.", system="Be brief."),
                 {"messages": [{"role": "user", "content": "Hello there"},
                               {"role": "assistant", "content": "Hello, how are you?"},
                               {"role": "user", "content": "I am fine, thank you."},
                               {"role": "assistant", "content": "Blue."}]}] * 4


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def write_chat_model(directory: Path) -> Path:
    """A random 2-layer LLaMA (d 32) with a chat template, as ``save_pretrained`` writes it."""
    import transformers

    tokenizer = train_tokenizer(TEXT)
    config = transformers.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=1, eos_token_id=END_OF_TURN,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}), encoding="utf-8")
    return directory


def chat_source(directory: Path) -> Source:
    """The tiny chat model of ``write_chat_model`` loaded as a fine-tuning starting point."""
    return load_source(str(write_chat_model(directory)), echo=lambda _: None)
