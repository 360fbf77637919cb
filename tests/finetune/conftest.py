"""Fixtures of the fine-tuning tests: a small text file and tiny random Hugging Face model directories."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from finetune_helpers import save_hf_dir, write_text


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    return write_text(tmp_path / "text.txt")


@pytest.fixture
def hf_dir(tmp_path: Path, text_file: Path) -> Callable[[str], Path]:
    """``hf_dir("llama" | "gpt2")``: a tiny random model of that family saved in tmp_path."""
    def make(kind: str) -> Path:
        return save_hf_dir(tmp_path / f"hf-{kind}", kind, text_file.read_text(encoding="utf-8"))
    return make
