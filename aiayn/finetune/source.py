"""What a fine-tune starts from, as data: a loaded model (``Source``), a language model's text front
end (``TextFront``) and its tokenizer with a character tokenizer's interface (``TokenizersText``).
``aiayn.tasks.sources`` loads them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig


@dataclass
class Source:
    """A loaded starting point.

    ``name``: what the user gave (a run records it as its task's ``init_from`` option). ``kind``:
    "gguf", "hf", "release" or "run". ``model``: plain float32 modules on the CPU, train mode.
    ``text``: for a decoder-only model, its ``aiayn.textgen.TextModel`` (tokenizer, ``eos_id``,
    ``chat_template``); None otherwise. ``run``: for a run or a shipped release, its
    ``aiayn.tasks.trained.LoadedRun`` (the task that made it, with its tokenizers); None otherwise."""

    name: str
    path: Path
    kind: str
    model: nn.Module
    config: ModelConfig
    text: Any = None
    run: Any = None


class TextFront(NamedTuple):
    """A loaded language model's text front end: its ``tokenizers.Tokenizer``, chat template (None:
    none) and end-of-text id (None: none)."""

    tokenizer: Any
    chat_template: Any
    eos_id: int | None


class TokenizersText:
    """A ``tokenizers.Tokenizer`` with ``CharTokenizer``'s interface: ids as tensors, no special tokens
    added (windows of a running text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> Tensor:
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)

    def decode(self, ids: Tensor | list[int]) -> str:
        return self.tokenizer.decode(ids.tolist() if isinstance(ids, Tensor) else list(ids))
