"""Tokenizers: character-level (nanoGPT's shakespeare-char), and BPE through the `tokenizers` library."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


class CharTokenizer:
    """One id per distinct character of a corpus, in sorted order (nanoGPT's shakespeare-char)."""

    def __init__(self, vocab: str, *, specials: tuple[str, ...] = ()) -> None:
        if len(set(vocab)) != len(vocab):
            raise ValueError("CharTokenizer vocab has repeated characters")
        self.vocab = vocab
        self.specials = specials  # extra ids after the characters, e.g. ("[MASK]",)
        self.char_to_id = {ch: i for i, ch in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str, *, specials: tuple[str, ...] = ()) -> CharTokenizer:
        return cls("".join(sorted(set(text))), specials=specials)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab) + len(self.specials)

    def special_id(self, name: str) -> int:
        return len(self.vocab) + self.specials.index(name)

    def encode(self, text: str) -> Tensor:
        unknown = sorted({ch for ch in text if ch not in self.char_to_id})
        if unknown:
            raise ValueError(f"text holds characters outside the vocabulary: {''.join(unknown)!r}; "
                             f"the model knows {self.vocab!r}")
        return torch.tensor([self.char_to_id[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: Tensor | list[int]) -> str:
        ids = ids.tolist() if isinstance(ids, Tensor) else ids
        return "".join(self.vocab[i] if i < len(self.vocab) else self.specials[i - len(self.vocab)] for i in ids)

    def to_tokenizers(self) -> Any:
        """The same ids as a ``tokenizers.Tokenizer`` (a word-level vocabulary of characters, no unknown token)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        vocab = {ch: i for i, ch in enumerate([*self.vocab, *self.specials])}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
        return tokenizer


# ---- BPE over the `tokenizers` library ----------------------------------------------------------

BPE_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0, 1, 2, 3 in every BPETokenizer
# The files a translation run keeps its BPE in: one joint vocabulary, or a source and a target one.
TOKENIZER_FILE = "tokenizer.json"  # a joint vocabulary
SOURCE_TOKENIZER_FILE, TARGET_TOKENIZER_FILE = "tokenizer.src.json", "tokenizer.tgt.json"


class BPETokenizer:
    """Byte-pair encoding (Sennrich et al., 2016) through Hugging Face ``tokenizers``: NFC text, spaces
    as the "▁" marker and punctuation split off, so decoding gives back the input text exactly.
    Ids 0-3 are <pad>, <s>, </s>, <unk>."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        for i, name in enumerate(BPE_SPECIALS):
            if tokenizer.token_to_id(name) != i:
                raise ValueError(f"not an aiayn BPE tokenizer: special token {name!r} is not id {i}")
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(4)

    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2) -> BPETokenizer:
        """Learn merges on ``texts`` (one joint vocabulary for everything given)."""
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
             pre_tokenizers.Punctuation()])
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=list(BPE_SPECIALS), show_progress=False)
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the library raises plain Exception for a corrupt file
            raise ValueError(f"cannot read tokenizer {path}: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json atomically (a temporary file renamed into place)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.tokenizer.save(str(tmp))
        os.replace(tmp, path)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Text -> ids, without <s>/</s> (the task adds them where the model needs them)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; special tokens are dropped and stop nothing (cut at </s> before calling)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return self.tokenizer.decode_batch(batch, skip_special_tokens=True)
