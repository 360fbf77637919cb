"""Sentence embeddings from a BERT-family model: token vectors pooled into one vector per text, as a
sentence-transformers layout says (else mean pooling and L2 normalisation). Shape letters: b batch,
t tokens, d d_model."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.device import autocast, model_device, resolve, to_device
from aiayn.interop.hf import load_hf
from aiayn.interop.mapping import InteropError

POOLING_MODES = ("mean", "cls", "max")
_ST_POOLING_KEYS = {  # sentence-transformers' flag -> our name (None: not supported)
    "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": None, "pooling_mode_weightedmean_tokens": None,
    "pooling_mode_lasttoken": None,
}


class EmbedError(InteropError):
    """A model directory or input that cannot be embedded; the message says what to change."""


def pool(hidden: Tensor, valid: Tensor, mode: str) -> Tensor:
    """hidden (b, t, d), valid (b, t) bool -> (b, d) pooled over the real tokens: sentence-transformers'
    mean, cls (the first token) or max."""
    if mode == "cls":
        return hidden[:, 0]
    keep = valid[..., None]  # (b, t, 1)
    if mode == "mean":
        total = (hidden * keep.to(hidden.dtype)).sum(dim=1)
        return total / keep.sum(dim=1).clamp(min=1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(~keep, float("-inf")).max(dim=1).values
    raise ValueError(f"unknown pooling {mode!r}; choose one of {', '.join(POOLING_MODES)}")


@dataclass
class SentenceEncoder:
    """A BERT-family ``EncoderOnly`` with its tokenizer, pooling and normalisation."""

    model: nn.Module
    tokenizer: Any  # tokenizers.Tokenizer
    pooling: str = "mean"
    normalize: bool = True
    max_length: int = 512
    pad_id: int = 0

    @torch.inference_mode()
    def encode(self, texts: list[str], *, batch_size: int = 32) -> Tensor:
        """texts -> (n, d) float32 embeddings on the CPU (unit length when ``normalize``)."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of texts; wrap a single text in a list")
        if not texts:
            raise EmbedError("no texts to embed; give at least one")
        empty = [i for i, text in enumerate(texts) if not text.strip()]
        if empty:
            raise EmbedError(f"text {empty[0] + 1} of {len(texts)} is empty; every text needs some words")
        device = model_device(self.model)
        out = []
        for start in range(0, len(texts), batch_size):
            tokens, valid = to_device(self.tokenize(texts[start:start + batch_size]), device)  # (b, t) each
            with autocast(device):  # bfloat16 on CUDA; nothing on the CPU
                hidden = self.model(tokens, valid=valid).hidden.float()  # (b, t, d)
            vectors = pool(hidden, valid, self.pooling)  # (b, d)
            out.append(F.normalize(vectors, p=2.0, dim=-1) if self.normalize else vectors)
        return torch.cat(out).cpu()  # (n, d); no copy on the CPU

    def tokenize(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """texts -> right-padded ids (b, t) and validity (b, t) on the CPU, truncated to ``max_length``."""
        encodings = self.tokenizer.encode_batch(texts)
        t = max(len(e.ids) for e in encodings)
        tokens = torch.full((len(texts), t), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(texts), t, dtype=torch.bool)
        for row, enc in enumerate(encodings):
            tokens[row, : len(enc.ids)] = torch.tensor(enc.ids, dtype=torch.long)
            valid[row, : len(enc.ids)] = True
        return tokens, valid


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EmbedError(f"{path}: not readable JSON ({exc})") from exc


def read_st_modules(directory: Path) -> tuple[str, bool, Path]:
    """(pooling, normalize, transformer directory) of a sentence-transformers layout."""
    modules = _read_json(directory / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise EmbedError(f"{directory / 'modules.json'}: expected a list of {{type, path}} objects")
    kinds = {str(m["type"]).rsplit(".", 1)[-1]: m for m in modules}
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown:
        raise EmbedError(f"{directory}: module(s) {', '.join(unknown)} in modules.json are not supported; "
                         f"aiayn embeds with Transformer -> Pooling [-> Normalize]")
    if "Transformer" not in kinds:
        raise EmbedError(f"{directory}: modules.json has no Transformer module")
    transformer_dir = directory / kinds["Transformer"].get("path", "")
    if "Pooling" not in kinds:
        raise EmbedError(f"{directory}: modules.json has no Pooling module; add 1_Pooling/config.json")
    config_path = directory / kinds["Pooling"].get("path", "1_Pooling") / "config.json"
    if not config_path.is_file():
        raise EmbedError(f"{config_path}: missing (the Pooling module's config)")
    cfg = _read_json(config_path)
    chosen = [key for key in _ST_POOLING_KEYS if cfg.get(key)]
    if len(chosen) != 1:
        raise EmbedError(f"{config_path}: exactly one pooling_mode_* must be true, got "
                         f"{', '.join(chosen) or 'none'}")
    pooling = _ST_POOLING_KEYS[chosen[0]]
    if pooling is None:
        raise EmbedError(f"{config_path}: {chosen[0]} is not supported; aiayn pools with "
                         f"{', '.join(POOLING_MODES)}")
    return pooling, "Normalize" in kinds, transformer_dir


def _load_tokenizer(directory: Path, lowercase: bool | None) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    if (directory / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    if (directory / "vocab.txt").is_file():  # a classic BERT directory: WordPiece with [CLS] ... [SEP]
        if lowercase is None:
            tok_cfg = directory / "tokenizer_config.json"
            lowercase = bool(_read_json(tok_cfg).get("do_lower_case", True)) if tok_cfg.is_file() else True
        return BertWordPieceTokenizer(str(directory / "vocab.txt"), lowercase=lowercase)
    raise EmbedError(f"{directory}: no tokenizer.json or vocab.txt; save the tokenizer with the model")


def load_sentence_encoder(directory: str | Path, *, pooling: str | None = None, normalize: bool | None = None,
                          device: torch.device | str | None = None) -> SentenceEncoder:
    """A ``SentenceEncoder`` from a BERT-family model directory; ``pooling`` / ``normalize`` override
    what the directory says. ``device`` None: the first CUDA GPU, else the CPU."""
    where = resolve(device)  # before loading: a missing device fails at once
    path = Path(directory)
    if not path.is_dir():
        raise EmbedError(f"{path}: not a model directory (expected config.json, weights and a tokenizer)")
    if (path / "modules.json").is_file():
        st_pooling, st_normalize, model_dir = read_st_modules(path)
    else:
        st_pooling, st_normalize, model_dir = "mean", True, path
    if not (model_dir / "config.json").is_file():
        raise EmbedError(f"{model_dir}: no config.json; not a Hugging Face model directory")
    if pooling is not None and pooling not in POOLING_MODES:
        raise EmbedError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLING_MODES)}")
    with warnings.catch_warnings():  # embeddings never use the MLM head a BertModel lacks
        warnings.filterwarnings("ignore", message=".*no tensors for the MLM head")
        model, config = load_hf(model_dir)
    if config.arch != "encoder-only":
        raise EmbedError(f"{model_dir} holds a {config.arch} model; sentence embeddings need a "
                         f"BERT-family (encoder-only) one")
    st_config = path / "sentence_bert_config.json"
    extra = _read_json(st_config) if st_config.is_file() else {}
    max_length = min(int(extra.get("max_seq_length") or config.max_seq_len), config.max_seq_len)
    tokenizer = _load_tokenizer(model_dir, extra.get("do_lower_case"))
    tokenizer.enable_truncation(max_length)
    tokenizer.no_padding()
    pad_id = config.pad_id if config.pad_id is not None else 0
    return SentenceEncoder(model.to(where).eval(), tokenizer, pooling=pooling or st_pooling,
                           normalize=st_normalize if normalize is None else normalize,
                           max_length=max_length, pad_id=pad_id)
