"""Tokenizers. Character-level here; BPE goes through the `tokenizers` library (translation issue)."""

from __future__ import annotations

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
