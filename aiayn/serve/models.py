"""What ``aiayn serve`` serves: a decoder-only text model (generation and embeddings) or a
sentence encoder (embeddings only), loaded from a GGUF file, a Hugging Face directory or a run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiayn.embed import SentenceEncoder, load_sentence_encoder
from aiayn.tasks.runs import load_text_model
from aiayn.textgen import TextModel


@dataclass
class ServedModel:
    """One model under one name: ``lm`` (decoder-only) or ``encoder`` (BERT-family), not both."""

    name: str
    lm: TextModel | None = None
    encoder: SentenceEncoder | None = None


def is_encoder_dir(path: Path) -> bool:
    """A sentence-transformers directory, or a Hugging Face directory of a BERT model."""
    if not path.is_dir():
        return False
    if (path / "modules.json").is_file():
        return True
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "bert"


def load_served_model(model_path: Path | None = None, run_dir: Path | None = None, *, name: str | None = None,
                      quantize: str = "none", plain: bool = False,
                      device: torch.device | str | None = None, adapter: Path | None = None) -> ServedModel:
    """The model of ``--model`` (GGUF file, Hugging Face or sentence-transformers directory) or
    ``--run``; ``quantize`` lowers a decoder's weights; ``device`` None: the first CUDA GPU, else the CPU;
    ``adapter``: a LoRA adapter directory merged into a decoder (``load_text_model``)."""
    source = model_path if model_path is not None else run_dir
    assert source is not None, "give a model path or a run directory"
    name = name or (source.stem if source.is_file() else source.resolve().name)
    if model_path is not None and is_encoder_dir(model_path):
        return ServedModel(name, encoder=load_sentence_encoder(model_path, device=device))
    lm = load_text_model(run_dir, model_path, plain=plain, quantize=quantize, device=device, adapter=adapter)
    return ServedModel(name, lm=lm)


def encoder_token_counts(encoder: SentenceEncoder, texts: list[str]) -> list[int]:
    """Tokens the encoder reads per text (after its truncation)."""
    return [len(e.ids) for e in encoder.tokenizer.encode_batch(texts)]


def vector_size(model: ServedModel) -> int:
    module: Any = model.lm.model if model.lm is not None else model.encoder.model  # type: ignore[union-attr]
    return int(module.config.d_model)
