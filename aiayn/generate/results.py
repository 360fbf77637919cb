"""What the decode loops produce: a ``DecodeStep`` per new token, collected into a ``GreedyResult``."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from aiayn.nn.kv_cache import KVCache


@dataclass(frozen=True)
class DecodeStep:
    """One step of a decode loop: tokens (b,) (a finished row: the fill id), the logits (b, v) they were
    chosen from (before sampling's changes), the rows generated (``active``) and finished (``done``),
    the KV cache as the step left it, and whether the window ``slid`` just before."""

    index: int
    tokens: Tensor
    logits: Tensor
    active: Tensor
    done: Tensor
    cache: KVCache | None = None
    slid: bool = False


class GreedyResult:
    """What a greedy decoder returns: tokens (b, n_new), logits (b, n_new, v) (stacked on first access),
    and (encoder-decoder) lengths (b,), eos included."""

    def __init__(self, tokens: Tensor, step_logits: list[Tensor], lengths: Tensor | None = None) -> None:
        self.tokens, self.lengths = tokens, lengths
        self._step_logits = step_logits  # n_new x (b, v)

    @functools.cached_property
    def logits(self) -> Tensor:
        return torch.stack(self._step_logits, 1)

    @classmethod
    def from_steps(cls, steps: Iterable[DecodeStep], *, with_lengths: bool = False) -> GreedyResult:
        """Run a decode loop to its end and collect its steps (``with_lengths``: count each row's)."""
        tokens: list[Tensor] = []
        logits: list[Tensor] = []
        lengths: Tensor | None = None
        for step in steps:
            tokens.append(step.tokens)
            logits.append(step.logits)
            if with_lengths:
                lengths = step.active.long() if lengths is None else lengths + step.active
        return cls(torch.stack(tokens, 1), logits, lengths)


def fill_finished(tokens: Tensor, finished: Tensor, fill_id: int | None) -> Tensor:
    """tokens (b,) with the rows of ``finished`` (b,) bool replaced by ``fill_id`` (None: kept)."""
    if fill_id is None:
        return tokens
    return torch.where(finished, torch.full_like(tokens, fill_id), tokens)


def fill_id_for(pad_id: int | None, eos_id: int | None, fill_id: int | None) -> int | None:
    """What a finished row holds: ``fill_id`` if given, else the model's pad_id, else eos_id."""
    if fill_id is not None:
        return fill_id
    return pad_id if pad_id is not None else eos_id


# The devices where a decode loop reads "is every row done?" one step late (``DoneCheck``).
LAGGED_DONE_DEVICES: tuple[str, ...] = ("cuda",)


class DoneCheck:
    """Whether every row is done, read without making a GPU wait: on a ``LAGGED_DONE_DEVICES`` device
    ``after`` copies the flag and ``stopped_before`` reads it a step later (one step dropped)."""

    def __init__(self, device: torch.device) -> None:
        self.lagged = device.type in LAGGED_DONE_DEVICES
        self._pending = False
        self._device = device
        if self.lagged:
            cuda = device.type == "cuda"
            self._host = torch.zeros((), dtype=torch.bool, pin_memory=cuda)  # the flag, copied here
            self._copied = torch.cuda.Event() if cuda else None  # set when the copy has landed

    def after(self, done: Tensor) -> bool:
        """Once a step is yielded, its ``done`` (b,): True to stop now, or False with the flag on its way."""
        if not self.lagged:
            return bool(done.all())
        self._host.copy_(done.all(), non_blocking=True)
        if self._copied is not None:  # on the stream of the loop's own GPU (not the current device's)
            self._copied.record(torch.cuda.current_stream(self._device))
        self._pending = True
        return False

    def stopped_before(self) -> bool:
        """True when the step before ended every row (lagged): drop the step just queued."""
        if not self._pending:
            return False
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's flag: the current step stays queued
        self._pending = False
        return bool(self._host)


def known_options(caller: str, options: Mapping[str, object], allowed: type) -> None:
    """Python's TypeError for an unexpected keyword, for ``**options: Unpack[allowed]`` (a greedy call given
    ``sampling=`` must not sample)."""
    unknown = [name for name in options if name not in allowed.__annotations__]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
