"""What a fine-tune starts from (``aiayn.tasks.sources`` loads them): a loaded model (``Source``), a language
model's text front end (``TextFront``), its tokenizer as a character tokenizer (``TokenizersText``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig


@dataclass
class Source:
    """A loaded starting point. ``name``: what the user gave (the task's ``init_from``); ``kind``: "gguf",
    "hf", "release" or "run"; ``model``: float32 on the CPU, train mode; ``text``: a decoder-only model's
    ``aiayn.textgen.TextModel``; ``run``: a run's or release's ``aiayn.tasks.trained.LoadedRun``."""

    name: str
    path: Path
    kind: str
    model: nn.Module
    config: ModelConfig
    text: Any = None
    run: Any = None


class TextFront(NamedTuple):
    """A loaded language model's ``tokenizers.Tokenizer``, chat template and end-of-text id (or None)."""

    tokenizer: Any
    chat_template: Any
    eos_id: int | None


class TokenizersText:
    """A ``tokenizers.Tokenizer`` with ``CharTokenizer``'s interface: ids as tensors, no special tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> Tensor:
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)

    def decode(self, ids: Tensor | list[int]) -> str:
        return self.tokenizer.decode(ids.tolist() if isinstance(ids, Tensor) else list(ids))
