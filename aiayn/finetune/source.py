"""A model to fine-tune: anything ``aiayn.load`` opens (a Hugging Face directory, a GGUF file, a
shipped model, a run directory), as trainable float32 modules with its text front end."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

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
