"""What the decode loops produce: one ``DecodeStep`` per new token position, and the
``GreedyResult`` the greedy functions collect from them."""

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
    """One step of a decode loop: the next token of every row.

    index: 0 for the first new token. tokens (b,): this step's token per row (a finished row: the
    fill id). logits (b, v): what the tokens were chosen from (before sampling's changes).
    active (b,): rows generated at this step. done (b,): rows finished after it.
    cache: the loop's KV cache as this step left it (read it before the next step), None without.
    slid: the window slid just before this step."""

    index: int
    tokens: Tensor
    logits: Tensor
    active: Tensor
    done: Tensor
    cache: KVCache | None = None
    slid: bool = False


class GreedyResult:
    """What a greedy decoder returns: tokens (b, n_new); logits (b, n_new, v), stacked on first access;
    lengths (b,) tokens per row, eos included (encoder-decoder), else None."""

    def __init__(self, tokens: Tensor, step_logits: list[Tensor], lengths: Tensor | None = None) -> None:
        self.tokens, self.lengths = tokens, lengths
        self._step_logits = step_logits  # n_new x (b, v)

    @functools.cached_property
    def logits(self) -> Tensor:
        return torch.stack(self._step_logits, 1)

    @classmethod
    def from_steps(cls, steps: Iterable[DecodeStep], *, with_lengths: bool = False) -> GreedyResult:
        """Run a decode loop to its end and collect its steps; ``with_lengths``: count each row's tokens."""
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
    """Whether every row of a decode loop is done, read without making a GPU wait: on a
    ``LAGGED_DONE_DEVICES`` device ``after`` copies the flag to the host and ``stopped_before`` reads
    it at the next step (one step more computed and dropped); elsewhere ``after`` reads it at once."""

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
    """The TypeError Python raises for an unexpected keyword, for a wrapper that passes ``options``
    on as ``**options: Unpack[allowed]`` (a TypedDict): a greedy call given ``sampling=`` must not
    sample."""
    unknown = [name for name in options if name not in allowed.__annotations__]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
