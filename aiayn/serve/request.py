"""What a request to the serve engine is, and what the engine tells it: data types only.

``SamplingParams``: one request's options; ``Request``: a prompt and its state while it waits and
runs; ``Event``: a generated token (its text, log-probability and finish reason) or an error;
``TokenLogprob``: a token's log-probability and its alternatives, as the API reports them.
"""

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
    """When one request stops and what it reports, around how its tokens are chosen: the one
    sampling config every decode loop takes (``aiayn.generate.SamplingConfig``: temperature 0 is
    greedy; top-k, top-p, the repetition penalty and the seed as ``aiayn generate`` has them),
    and OpenAI's ``logit_bias`` ((token id, added to its logit) pairs), ``presence_penalty`` and
    ``frequency_penalty``."""

    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the k most likely
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes this request's logits (``sampler.RowAdjustments``)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.sampling.repetition_penalty != 1.0)


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (before bias, penalties, grammar,
    temperature and top_p), and the ``top`` most likely alternatives as (text, logprob) pairs."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Event:
    """What the engine tells a request: text to show (possibly empty: held back), the token's
    log-probability when asked, and the finish reason ("stop", "length") or an error."""

    text: str
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    error: str | None = None
    token: int | None = None  # the generated token's id (None for an error)


_ids = itertools.count()


class Request:
    """A prompt (token ids) to continue under ``params``; its events go to ``sink``. ``constraint``:
    the grammar its answer must follow (structured output), this request's own state (not shared)."""

    def __init__(self, prompt: list[int], params: SamplingParams, sink: Callable[[Event], None],
                 constraint: GrammarConstraint | None = None) -> None:
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        self.id = next(_ids)
        self.prompt, self.params, self.sink = prompt, params, sink
        self.cancelled = False  # set from any thread; the engine frees the row at its next step
        self.arrived = time.monotonic()
        # Where its time to first token goes (time.monotonic(); set once, kept over a preemption):
        # arrived -> admitted (a row and blocks) -> its first prefill forward -> its first token.
        self.admitted_at: float | None = None
        self.prefill_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.fed = 0  # prompt tokens in the cache
        self.generated = 0
        self.last_token = -1
        self.finished = False
        self.seed = params.sampling.seed if params.sampling.seed is not None else random.getrandbits(63)
        # The draws' generator, made on the model's device when the engine admits the request.
        self.generator: torch.Generator | None = None
        self.text: IncrementalText | None = None  # set by the output stage (it knows the tokenizer)
        self.constraint = constraint  # advanced with each token on the engine thread
        self.adjustments: Any = None  # the sampler's bias / penalty tensors (RowAdjustments), made on the first token

    def release(self) -> None:
        """Drop the per-request state the sampler holds (grammar, device tensors): it has finished."""
        self.constraint = self.adjustments = None
