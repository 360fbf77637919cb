"""What a request to the serve engine is, and what the engine tells it: data types only."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from aiayn.generate.constrain import GrammarConstraint
from aiayn.generate.sampling import SamplingConfig
from aiayn.generate.text import IncrementalText


@dataclass(frozen=True)
class SamplingParams:
    """One request's options: ``sampling`` (``aiayn.generate.SamplingConfig``), when it stops, what
    it reports, and OpenAI's ``logit_bias`` ((token id, added value) pairs) and penalties."""

    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the k most likely
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes this request's logits."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.sampling.repetition_penalty != 1.0)


@dataclass
class TokenLogprob:
    """A generated token's log-probability (before bias, penalties, grammar and sampling), and the
    ``top`` alternatives as (text, logprob) pairs."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Event:
    """A generated token for a request: its text (possibly empty: held back), log-probability when
    asked, finish reason ("stop", "length") or an error."""

    text: str
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    error: str | None = None
    token: int | None = None  # the generated token's id (None for an error)


_ids = itertools.count()


class Request:
    """A prompt (token ids) to continue under ``params``; events go to ``sink``; ``constraint``: its grammar."""

    def __init__(self, prompt: list[int], params: SamplingParams, sink: Callable[[Event], None],
                 constraint: GrammarConstraint | None = None) -> None:
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        self.id = next(_ids)
        self.prompt, self.params, self.sink = prompt, params, sink
        self.cancelled = False  # set from any thread; the engine frees the row at its next step
        self.arrived = time.monotonic()
        # time.monotonic() of its admission, first prefill forward and first token (kept over a preemption)
        self.admitted_at: float | None = None
        self.prefill_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.fed = 0  # prompt tokens in the cache
        self.generated = 0
        self.last_token = -1
        self.finished = False
        self.seed = params.sampling.seed if params.sampling.seed is not None else random.getrandbits(63)
        self.generator: torch.Generator | None = None  # made on the model's device at admission
        self.text: IncrementalText | None = None  # set by the output stage (it knows the tokenizer)
        self.constraint = constraint  # advanced with each token on the engine thread
        self.adjustments: Any = None  # the sampler's bias / penalty tensors (RowAdjustments), made on the first token

    def release(self) -> None:
        """Drop the per-request state the sampler holds (grammar, device tensors): it has finished."""
        self.constraint = self.adjustments = None
