"""Language modelling on your own text files: ``aiayn train --task text --data FILE...``.

From scratch the vocabulary (characters, or with ``tokenizer: bpe`` a byte-level BPE) is learned from the
files and kept in the run's options; with ``init_from`` the run continues that model with its tokenizer.
Without ``val_data`` a seeded share of the text validates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from aiayn.config import ConfigError, ModelConfig
from aiayn.data.parallel import DataError
from aiayn.finetune.source import TokenizersText
from aiayn.finetune.split import split_examples
from aiayn.generate import SamplingConfig
from aiayn.tasks.base import register
from aiayn.tasks.language_model import ATTENTION_TOKENS, BPETokenizer, CausalTextTask
from aiayn.tasks.sources import SourceOption
from aiayn.tokenizers import CharTokenizer

TOKENIZERS = ("char", "bpe")
SPLIT_PIECES = 100  # a text without --val-data is cut into this many runs of whole lines (fewer if short)


def read_text_files(paths: list[str]) -> str:
    """The files' text, one after the other, each checked (UTF-8, no NUL byte): a ``DataError`` names the
    file and line of a problem."""
    texts = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"{path}: {'a folder' if path.is_dir() else 'not found'}; give a text file")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line, column = _position(raw, exc.start)
            raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}); convert "
                            f"the file to UTF-8, e.g. iconv -f latin1 -t utf-8") from None
        if (nul := raw.find(b"\0")) >= 0:
            line, column = _position(raw, nul)
            raise DataError(f"{path}:{line}: a NUL byte at column {column} (a binary file?); give plain text")
        if not text.strip():
            raise DataError(f"{path}:1: the file holds no text; give a file with some")
        text = text.removeprefix("\ufeff")
        texts.append(text if text.endswith("\n") else text + "\n")
    return "".join(texts)


def _position(raw: bytes, offset: int) -> tuple[int, int]:
    """(line, column), counted from 1, of byte ``offset``."""
    return raw.count(b"\n", 0, offset) + 1, offset - (raw.rfind(b"\n", 0, offset) + 1) + 1


def split_text(text: str, share: float, seed: int) -> tuple[str, str]:
    """(train, validation): of up to ``SPLIT_PIECES`` runs of whole lines, a ``share`` (at least one)
    chosen by ``seed`` validates; each part keeps the text's order."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 2:
        raise DataError("the text is a single line, too little to hold some out for validation; give "
                        "--val-data FILE")
    n = min(SPLIT_PIECES, len(lines))
    bounds = [round(i * len(lines) / n) for i in range(n + 1)]
    pieces = ["".join(lines[bounds[i]:bounds[i + 1]]) for i in range(n)]
    split = split_examples(n, seed=seed, fraction=share, what="runs of lines", instead="give --val-data FILE")
    return "".join(pieces[i] for i in split.train), "".join(pieces[i] for i in split.val)


@register
class TextTask(CausalTextTask):
    name = "text"
    description = "language modelling on your own text files (--data), from scratch or --init-from a model"
    recorded_options = ("vocab", "bpe")  # a vocabulary learned from scratch (characters, or the BPE's JSON)
    attention_needs_splits = True

    def __init__(self, *, data: list[str] | None = None, val_data: list[str] | None = None,
                 init_from: str | None = None, tokenizer: str | None = None, vocab_size: int | None = None,
                 val_share: float = 0.1, block_size: int = 64, **options: Any) -> None:
        if not data:
            raise ConfigError("task text needs the text to learn from: give --data FILE (one or more)")
        if tokenizer is not None and tokenizer not in TOKENIZERS:
            raise ConfigError(f"task text: tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
        if init_from is not None and (tokenizer is not None or vocab_size is not None):
            raise ConfigError("task text: tokenizer and vocab_size are for a model from scratch; with --init-from "
                              "the loaded model's tokenizer is used")
        if not 0 < val_share < 1:
            raise ConfigError(f"task text: val_share must be between 0 and 1, got {val_share}")
        self.source = SourceOption(init_from)
        self._tokenizer: Any = None
        given = {key: value for key, value in dict(
            init_from=init_from, val_data=val_data, tokenizer=tokenizer, vocab_size=vocab_size).items()
            if value is not None}
        super().__init__(block_size=block_size, data=list(data), val_share=val_share, **given, **options)

    @property
    def tokenizer(self) -> Any:
        """Learned from scratch, or the loaded model's."""
        if self._tokenizer is None and self.source.given:
            self._tokenizer = TokenizersText(self.source.front(self.run_dir).tokenizer)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer = value

    @property
    def eos_id(self) -> int | None:
        return self.source.front(self.run_dir).eos_id if self.source.given else None

    @property
    def chat_template(self) -> Any:
        return self.source.front(self.run_dir).chat_template if self.source.given else None

    def make_tokenizer(self) -> Any:
        """From scratch: the vocabulary the run's options record, learned the first time; else None."""
        if self.source.given:
            return None
        kind = self.options.get("tokenizer", "char")
        if kind == "char":
            if self.options.get("vocab") is None:
                self.options["vocab"] = CharTokenizer.from_text(self._all_text()).vocab
            return CharTokenizer(self.options["vocab"])
        if self.options.get("bpe") is None:
            self.options["bpe"] = BPETokenizer.train(self._all_text(), self.options.get("vocab_size", 1024)).json
        return TokenizersText(BPETokenizer(self.options["bpe"]).tokenizer)

    def _all_text(self) -> str:
        return read_text_files([*self.options["data"], *self.options.get("val_data", [])])

    def model_config(self) -> ModelConfig:
        if not self.source.given:
            return super().model_config()
        config = self.source.get().config
        self.source.text()  # refuses a model without a text front end now, before a run is made
        if self.block_size > config.max_seq_len:
            raise ConfigError(f"task text: block_size {self.block_size} is longer than the context of "
                              f"{self.source.name} ({config.max_seq_len} tokens); give a smaller block_size")
        return config

    def train_overrides(self) -> dict[str, Any]:
        if not self.source.given:
            return super().train_overrides()
        # Fine-tuning: transformers' Trainer defaults (AdamW 5e-5, linear decay, no warmup), one epoch.
        return dict(epochs=1, batch_size=8, lr=5e-5, schedule="linear", warmup_steps=0, optimizer="adamw",
                    weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad_norm=1.0, eval_every=0,
                    save_every=0)

    def build_model(self, config: ModelConfig) -> nn.Module:
        if not self.source.given:
            return super().build_model(config)
        return self.source.build_model(config, self.run_dir)

    def setup_notes(self, seed: int) -> list[str]:
        """The validation split the run makes, which the user did not spell out."""
        if self.options.get("val_data"):
            return []
        return [f"validation: {self.options['val_share']:.0%} of the text (runs of whole lines chosen with seed "
                f"{seed}); give --val-data FILE to choose it yourself"]

    def prepare(self, seed: int) -> None:
        text = read_text_files(self.options["data"])
        if self.options.get("val_data"):
            train, val = text, read_text_files(self.options["val_data"])
        else:
            train, val = split_text(text, self.options["val_share"], seed)
        if self.source.given and self.run_dir is not None:
            self.source.keep_front(self.run_dir)
        self.tokens = {"train": self.tokenizer.encode(train), "val": self.tokenizer.encode(val)}
        for split, tokens in self.tokens.items():
            if len(tokens) < self.block_size + 2:
                raise DataError(f"the {split} text is {len(tokens)} tokens, too few for one window of "
                                f"block_size {self.block_size} (+ 2); give more text or a smaller block_size")

    def validation_start(self) -> Tensor:
        return self.tokens["val"][:ATTENTION_TOKENS]

    def examples(self, model: nn.Module, n: int = 1) -> list[str]:
        prompt = self.tokenizer.decode(self.tokens["val"][:1])  # a token the vocabulary surely holds
        text = self.sample(model, prompt, max_new_tokens=min(200, self.block_size - 1),
                           sampling=SamplingConfig(temperature=0.8, top_k=40, seed=0))
        return [f"sample: {text!r}"]
