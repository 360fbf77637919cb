"""Padding-free ("packed") token-wise layers: only attention mixes positions and never attends to a
padded key, so the residual stream can live packed, (n, d), and only the attention core sees (b, t).

Shape letters: b batch, t padded length, n real tokens, f any trailing feature dimensions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.device import to_device


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded (b, t) batch sit: their row-major flat indices."""

    index: Tensor  # (n,) long, b_i * t + t_i of each real token, in order
    batch: int  # b
    length: int  # t

    @classmethod
    def of(cls, valid: Tensor) -> Packing:
        b, t = valid.shape
        return cls(valid.reshape(-1).nonzero().squeeze(1), b, t)

    @classmethod
    def of_counts(cls, counts: Sequence[int], length: int, device: torch.device) -> Packing:
        """Right-padded rows whose real tokens are each row's first ``counts[i]``, known on the host."""
        if any(not 0 <= n <= length for n in counts):
            raise ValueError(f"counts {list(counts)} must lie in [0, {length}]")
        index = torch.tensor([i * length + j for i, n in enumerate(counts) for j in range(n)], dtype=torch.long)
        return cls(to_device(index, device), len(counts), length)

    @property
    def n_tokens(self) -> int:
        return self.index.shape[0]

    @property
    def full(self) -> bool:
        """Every token is real (the index is then 0 .. b * t - 1): packing is a reshape."""
        return self.n_tokens == self.batch * self.length

    def pack(self, x: Tensor) -> Tensor:
        """(b, t, *f) -> (n, *f): the real tokens' rows."""
        rows = x.reshape(self.batch * self.length, *x.shape[2:])
        return rows if self.full else rows.index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(n, *f) -> (b, t, *f), zeros at padding."""
        if self.full:
            return x.view(self.batch, self.length, *x.shape[1:])
        rows = x.new_zeros(self.batch * self.length, *x.shape[1:])
        rows.index_copy_(0, self.index, x)  # in place: out of place would copy the zeros once more
        return rows.view(self.batch, self.length, *x.shape[1:])
