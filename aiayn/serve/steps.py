"""The forwards of a serve engine step (``aiayn.serve.engine.Engine`` inherits them): which prompt
tokens the prefill feeds (``aiayn.serve.schedule``), the decoding rows' tokens, and the one packed
forward that runs them (``aiayn.generate.step.decode_ragged``) - the prefill chunk alone, the
decoding rows alone, or both together (the mixed step, ``_prefill(decoding)``). They read and change the engine's rows
(decoding rows first, then prefilling ones) and its cache.

Shape letters: d decoding rows, k prefilling rows of this step, n tokens in the forward, m
positions whose logits are wanted, v vocabulary.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from aiayn.device import to_device
from aiayn.generate.step import decode_ragged
from aiayn.models.blocks import RaggedBatch
from aiayn.nn.paged_kv_cache import PagedKVCache
from aiayn.nn.row_kv_cache import RowKVCache
from aiayn.serve.blocks import BlockScheduler
from aiayn.serve.metrics import Metrics
from aiayn.serve.schedule import prefill_plan

if TYPE_CHECKING:
    from torch import nn

    from aiayn.serve.compiled_step import CompiledRows
    from aiayn.serve.engine import Request


class ForwardSteps:
    """The prefill, decode and mixed forwards of a step (the module docstring)."""

    model: nn.Module
    device: torch.device
    cache: RowKVCache | PagedKVCache
    blocks: BlockScheduler | None
    rows: list[Request]
    n_decode: int
    mixed_steps: bool
    prefill_chunk: int
    compiled: CompiledRows | None
    metrics: Metrics

    def _sample_and_emit(self, logits: Tensor, requests: list[Request]) -> None: ...  # (Engine's)
    def _swap(self, i: int, j: int) -> None: ...  # (Engine's)

    def _sequence(self, request: Request) -> list[int]:
        """What ``request``'s row must hold before it samples: its prompt (after a preemption, its
        prompt and answer so far)."""
        return self.blocks.sequence(request) if self.blocks is not None else request.prompt

    def _prefill_batch(self) -> list[tuple[Request, int]]:
        """The prefilling rows of this step's chunk with the tokens each feeds (``prefill_plan``:
        fewest tokens left first, at most ``prefill_chunk`` tokens in all), moved to the first
        prefilling rows in that order."""
        pending = self.rows[self.n_decode:]
        plan = prefill_plan([len(self._sequence(r)) - r.fed for r in pending], self.prefill_chunk)
        for slot, (index, _) in enumerate(plan):
            self._swap(self.rows.index(pending[index]), self.n_decode + slot)
        return [(pending[index], take) for index, take in plan]

    def _mixes(self) -> bool:
        """Whether this step's prefill chunk goes into one forward with the decoding rows (some row
        decodes, mixed steps on); else the chunk runs alone and a row it finishes joins the decode
        forward of the same step."""
        return bool(self.n_decode) and self.mixed_steps

    def _prefill(self, decoding: list[Request] | None = None) -> None:
        """Feed the prefilling rows up to ``prefill_chunk`` prompt tokens, and with ``decoding``
        (the decoding rows, a mixed step) their next tokens in the same forward (``decode_ragged``:
        the weights read once for both). Rows whose prompt is done sample their first token and
        join the decoding rows (a mixed step's decode from the next step on)."""
        decoding = decoding or []
        start, batch, parts = self._prefill_parts()
        done = self._feeding(batch)
        batches = [self._decode_batch(decoding), *parts] if decoding else parts
        at = list(range(len(decoding))) + [len(decoding) + last for _, last in done]  # in the packed tokens
        logits = self._forward(batches, at)  # (d + m, v)
        self._prefilled(start, batch)
        requests = [*decoding, *self._join(batch, done)]
        if requests:
            self._sample_and_emit(logits, requests)
        if decoding:
            self.metrics.batch_size.observe(len(decoding))

    def _decode(self) -> None:
        """One token for every decoding row (``--compile``: through the compiled graph of its bucket)."""
        requests = self.rows[: self.n_decode]
        if self.compiled is not None:  # (fixed slots only: no blocks to take)
            logits = self.compiled.step([r.last_token for r in requests])  # (d, v)
        else:
            logits = self._forward([self._decode_batch(requests)], list(range(len(requests))))  # (d, v)
        self._sample_and_emit(logits, requests)
        self.metrics.batch_size.observe(len(requests))

    def _forward(self, batches: list[RaggedBatch], at: list[int]) -> Tensor:
        """One forward over ``batches`` -> the logits (m, v) of the packed tokens ``at`` names."""
        return decode_ragged(self.model, batches, to_device(torch.tensor(at, dtype=torch.long), self.device))

    def _decode_batch(self, requests: list[Request]) -> RaggedBatch:
        """The decoding rows (the first ``len(requests)``) feeding their last tokens: (d, 1). A
        generated token is real whatever its id (also one equal to pad_id), as in the library's loops."""
        tokens = to_device(torch.tensor([[r.last_token] for r in requests], dtype=torch.long), self.device)
        if self.blocks is not None:
            for request in requests:
                self.blocks.decoding(request)
        return RaggedBatch(tokens, [1] * len(requests), self.cache.rows(0, len(requests)))

    def _prefill_parts(self) -> tuple[int, list[tuple[Request, int]], list[RaggedBatch]]:
        """This step's prefill chunk (``_prefill_batch``): its first row, its rows with the tokens
        each feeds, and a part per row, (1, take) over its own one-row view of the cache (no row
        padded to another's width; the token ids built on the host, one copy)."""
        start, batch = self.n_decode, self._prefill_batch()
        ids = [token for request, take in batch for token in self._sequence(request)[request.fed: request.fed + take]]
        flat = to_device(torch.tensor(ids, dtype=torch.long), self.device)  # (n,)
        parts, offset = [], 0
        for i, (_, take) in enumerate(batch):
            parts.append(RaggedBatch(flat[offset: offset + take][None], [take], self.cache.rows(start + i, start + i + 1)))
            offset += take
        return start, batch, parts

    def _feeding(self, batch: list[tuple[Request, int]]) -> list[tuple[int, int]]:
        """Count the chunk's tokens as fed; the rows whose prompt it ends, as (index in the batch,
        its last token's index among the chunk's tokens, packed row after row)."""
        done, now, offset = [], time.monotonic(), 0
        for i, (request, take) in enumerate(batch):
            request.prefill_at = request.prefill_at or now
            request.fed += take
            offset += take
            if request.fed == len(self._sequence(request)):
                done.append((i, offset - 1))
        return done

    def _prefilled(self, start: int, batch: list[tuple[Request, int]]) -> None:
        if self.blocks is not None:  # the full blocks of prompts are indexed as soon as they are computed
            for i, (request, _) in enumerate(batch):
                self.blocks.filled(request, start + i)

    def _join(self, batch: list[tuple[Request, int]], done: list[tuple[int, int]]) -> list[Request]:
        """The rows whose prompt is done move into the decoding rows, in order; returned."""
        finished = [batch[i][0] for i, _ in done]
        for request in finished:
            self._swap(self.rows.index(request), self.n_decode)
            self.n_decode += 1
        return finished
