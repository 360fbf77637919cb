"""How the serve engine chooses each row's next token: ``choose`` turns one forward's logits into
token ids (and the log-probabilities asked for), the step's one read from the device. Per row, in
vLLM's order: logit bias, penalties, grammar mask, then argmax or a draw.

Shape letters: m rows of the forward, v vocabulary, k alternatives reported."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from aiayn.generate.constrain import mask_rows
from aiayn.generate.sampling import sample_next
from aiayn.serve.request import SamplingParams

if TYPE_CHECKING:
    from aiayn.serve.request import Request


@dataclass
class Chosen:
    """A chosen token's log-probability and its ``top`` alternatives as (token id, logprob), best first."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class RowAdjustments:
    """One request's logit bias and penalties as device tensors, made on its first token."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab: int, device: torch.device) -> None:
        self.params = params
        self.bias_ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=device)  # (b,)
        self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        self.repetition = params.sampling.repetition_penalty
        distinct = sorted({t for t in prompt if 0 <= t < vocab}) if self.repetition != 1.0 else []
        self.prompt_ids = torch.tensor(distinct, dtype=torch.long, device=device)  # (p,)
        self.answer = torch.zeros(params.max_tokens, dtype=torch.long, device=device)  # (max_tokens,) ids so far
        self.n = 0  # tokens in ``answer``

    def record(self, token: Tensor) -> None:
        """token (1,) long on the device: the row's chosen id, written there."""
        if self.n < self.answer.numel():
            self.answer[self.n: self.n + 1] = token
            self.n += 1


def apply_adjustments(logits: Tensor, rows: list[tuple[int, RowAdjustments]]) -> None:
    """logits (m, v) float32 in place, at the ids concerned only: the bias added, CTRL's repetition
    penalty, and OpenAI's ``- frequency * c - presence * [c > 0]`` over the answer's token counts."""
    v = logits.shape[-1]
    flat = logits.view(-1)  # (m v,): logits is contiguous
    device = logits.device

    def spread(values: list[Any], parts: list[tuple[int, Tensor, int]], dtype: Any = np.int64) -> Tensor:
        """One value per part -> (K,) on the host, repeated over its part's k ids (numpy: faster here)."""
        return torch.from_numpy(np.repeat(np.asarray(values, dtype=dtype), [k for *_, k in parts]))

    def positions(parts: list[tuple[int, Tensor, int]]) -> tuple[Tensor, Tensor]:
        """(row, ids (k,), k) parts -> (row of each id (K,) long on the host, ids (K,) on the device)."""
        return spread([r for r, _, _ in parts], parts), torch.cat([ids for _, ids, _ in parts])

    def per_id(values: list[float], parts: list[tuple[int, Tensor, int]]) -> Tensor:
        """One value per part -> (K,) float32 on the device, repeated over the part's ids."""
        return spread(values, parts, np.float32).to(device)

    biased = [(r, a.bias_ids, a.bias_ids.numel()) for r, a in rows if a.params.logit_bias]
    if biased:
        rows_of, ids = positions(biased)
        flat.index_add_(0, rows_of.to(device) * v + ids, torch.cat([a.bias_values for _, a in rows if a.params.logit_bias]))
    repeated = [(r, a) for r, a in rows if a.repetition != 1.0 and a.prompt_ids.numel() + a.n]
    if repeated:
        parts = [(r, torch.cat([a.prompt_ids, a.answer[: a.n]]), a.prompt_ids.numel() + a.n) for r, a in repeated]
        rows_of, ids = positions(parts)
        where = rows_of.to(device) * v + ids  # (K,)
        penalty = per_id([a.repetition for _, a in repeated], parts)
        seen = flat[where]
        flat.index_put_((where,), torch.where(seen > 0, seen / penalty, seen * penalty))
    penalised = [(r, a) for r, a in rows if (a.params.presence_penalty or a.params.frequency_penalty) and a.n]
    if penalised:
        parts = [(r, a.answer[: a.n], a.n) for r, a in penalised]
        rows_of, ids = positions(parts)
        local = spread(list(range(len(parts))), parts)  # (K,): each id's answer, 0 .. len(parts) - 1
        scratch = torch.zeros(len(parts) * v, dtype=torch.float32, device=device)
        at = local.to(device) * v + ids  # (K,) in the scratch
        scratch.index_add_(0, at, torch.ones_like(at, dtype=torch.float32))
        counts = scratch[at]  # (K,)
        where = rows_of.to(device) * v + ids  # (K,) in the logits
        frequency = per_id([a.params.frequency_penalty for _, a in penalised], parts)
        presence = per_id([a.params.presence_penalty for _, a in penalised], parts)
        flat.index_put_((where,), flat[where] - counts * frequency - (counts > 0).float() * presence)


def choose(logits: Tensor, requests: Sequence[Request]) -> list[tuple[int, Chosen | None]]:
    """logits (m, v) of one forward -> each row's (token id, its log-probabilities or None)."""
    logits = logits.float().contiguous()  # (m, v), changed in place below
    asks = [r.params.logprobs for r in requests if r.params.logprobs is not None]
    logprobs = torch.log_softmax(logits, dim=-1) if asks else None  # (m, v): the raw model's
    adjusted: list[tuple[int, RowAdjustments]] = []
    for i, request in enumerate(requests):
        if request.params.adjusts_logits:
            if request.adjustments is None:
                request.adjustments = RowAdjustments(request.params, request.prompt, logits.shape[-1], logits.device)
            adjusted.append((i, request.adjustments))
    if adjusted:  # most steps adjust nothing: skip the index building
        apply_adjustments(logits, adjusted)
    constraints = [r.constraint for r in requests]
    if any(c is not None for c in constraints):
        with one_thread(logits.device):
            mask_rows(logits, constraints)
    chosen = logits.argmax(dim=-1)  # (m,) greedy, replaced where a request samples
    # sample_next's ids so far: none, so its own repetition penalty does nothing (applied above).
    no_history = logits.new_empty(1, 0, dtype=torch.long)
    for i, request in enumerate(requests):
        if request.params.sampling.temperature > 0:
            chosen[i] = sample_next(logits[i: i + 1], no_history, request.params.sampling, request.generator)[0]
    for i, adjustments in adjusted:
        adjustments.record(chosen[i: i + 1])
    if logprobs is None:
        return [(token, None) for token in chosen.tolist()]  # the read
    k = max(asks)  # alternatives for the request that wants the most; each takes its first
    values, ids = logprobs.topk(k, dim=-1)  # (m, k) each, best first
    own = logprobs.gather(1, chosen[:, None])  # (m, 1): the chosen token's
    # One (m, 2 + 2k) float64 table (ids < 2^53 are exact in it), one copy: the read.
    table = torch.cat([chosen[:, None].double(), own.double(), values.double(), ids.double()], dim=1)
    out: list[tuple[int, Chosen | None]] = []
    for request, row in zip(requests, table.tolist(), strict=True):
        token, top = int(row[0]), request.params.logprobs
        info = None if top is None else Chosen(row[1], [(int(j), v) for v, j in zip(
            row[2: 2 + top], row[2 + k: 2 + k + top], strict=True)])
        out.append((token, info))
    return out


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Run the block on one torch thread on the CPU: the grammar mask's small ops would each open an
    OpenMP region, which on shared cores costs more than the work."""
    before = torch.get_num_threads()
    if device.type != "cpu" or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

