"""How the serve engine chooses each row's next token, and what a request asks of it.

``SamplingParams`` is one request's options (the library's ``SamplingConfig`` for how tokens are
drawn, plus when to stop and what to report); ``choose`` turns one forward's logits into each
row's token (and the log-probabilities asked for). It makes the engine step's one read from the
device: the chosen ids must reach the host to be detokenised (and fed back next step); with them,
in the same copy, come the log-probabilities.

Shape letters: m rows of the forward, v vocabulary, k alternatives reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from aiayn.generate.sampling import SamplingConfig, sample_next

if TYPE_CHECKING:
    from aiayn.serve.engine import Request


@dataclass(frozen=True)
class SamplingParams:
    """When one request stops and what it reports, around how its tokens are chosen: the one
    sampling config every decode loop takes (``aiayn.generate.SamplingConfig``: temperature 0 is
    greedy; top-k, top-p, the repetition penalty and the seed as ``aiayn generate`` has them)."""

    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the k most likely


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (before temperature / top_p), and the
    ``top`` most likely alternatives as (text, logprob) pairs."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


def choose(logits: Tensor, requests: Sequence[Request],
           decode: Callable[[list[int]], str]) -> list[tuple[int, TokenLogprob | None]]:
    """logits (m, v) of one forward -> each row's (token id, its log-probability or None).

    Greedy rows take the argmax; a sampling row draws from its own generator (``Request.generator``,
    seeded per request). ``decode`` turns ids into the text the log-probabilities report."""
    logits = logits.float()  # (m, v)
    chosen = logits.argmax(dim=-1)  # (m,) greedy, replaced where a request samples
    no_history = logits.new_empty(1, 0, dtype=torch.long)  # sample_next's ids so far (none)
    for i, request in enumerate(requests):
        if request.params.sampling.temperature > 0:
            chosen[i] = sample_next(logits[i: i + 1], no_history, request.params.sampling, request.generator)[0]
    asks = [r.params.logprobs for r in requests if r.params.logprobs is not None]
    if not asks:
        return [(token, None) for token in chosen.tolist()]  # the read
    logprobs = torch.log_softmax(logits, dim=-1)  # (m, v)
    k = max(asks)  # alternatives for the request that wants the most; each takes its first
    values, ids = logprobs.topk(k, dim=-1)  # (m, k) each, best first
    own = logprobs.gather(1, chosen[:, None])  # (m, 1): the chosen token's
    # One (m, 2 + 2k) float64 table (ids < 2^53 are exact in it), one copy: the read.
    table = torch.cat([chosen[:, None].double(), own.double(), values.double(), ids.double()], dim=1)
    out: list[tuple[int, TokenLogprob | None]] = []
    for request, row in zip(requests, table.tolist(), strict=True):
        token, top = int(row[0]), request.params.logprobs
        info = None if top is None else token_logprob(decode, token, row[1], row[2: 2 + top], row[2 + k: 2 + k + top])
        out.append((token, info))
    return out


def token_logprob(decode: Callable[[list[int]], str], token: int, logprob: float, values: list[float],
                  ids: list[float]) -> TokenLogprob:
    """The chosen ``token``'s log-probability and its alternatives (``values`` of the ``ids``,
    best first), as the API reports them."""
    alternatives = [(decode([int(j)]), v) for v, j in zip(values, ids, strict=True)]
    return TokenLogprob(decode([token]), logprob, alternatives)
