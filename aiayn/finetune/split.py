"""A fine-tune's validation set when given no file: a seeded share of its examples, stated in one line."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiayn.data.parallel import DataError

VAL_FRACTION = 0.05  # the share of the examples held out when no validation file is given


@dataclass(frozen=True)
class Split:
    """Disjoint ascending indices into the examples, and the line a run prints to say how val was made."""

    train: list[int]
    val: list[int]
    statement: str


def split_examples(n: int, *, seed: int, fraction: float = VAL_FRACTION, what: str = "examples",
                   instead: str = "give --val-data") -> Split:
    """Hold out ``fraction`` of ``n`` examples (at least 1, leaving 1), drawn by ``seed``; ``what`` names them
    and ``instead`` how to give one's own validation set."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must lie in (0, 1), got {fraction}")
    if n < 2:
        raise DataError(f"too few {what} to split off a validation set ({n}; it takes at least 2); "
                        f"add {what}, or {instead}")
    n_val = min(n - 1, max(1, round(n * fraction)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    val = sorted(order[:n_val])
    train = sorted(order[n_val:])
    statement = f"validation: {fraction:.0%} of the {what} ({n_val}), seed {seed}; {instead} to choose"
    return Split(train=train, val=val, statement=statement)
