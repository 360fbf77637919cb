"""The serve engine's runner: the model, its KV cache and the forwards. It applies a step plan's
cache operations and turns the plan into logits.

A forward packs the decoding rows' last tokens, (d, 1), and a part per prefilling row, (1, take)
over its own one-row view of the cache, into one ``decode_ragged`` call: one read of the weights,
no padding, each row computed as if alone. Nothing is read back from the device here.

Shape letters: d decoding rows, n tokens in the forward, m positions whose logits are wanted, v
vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.device import model_device, to_device
from aiayn.generate.step import decode_ragged
from aiayn.models.blocks import RaggedBatch
from aiayn.models.decoder_only import DecoderOnly
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.paged_kv_cache import PagedKVCache
from aiayn.serve.blocks import BlockPlan, SlotPlan
from aiayn.serve.compiled_step import CompiledRows
from aiayn.serve.request import Request
from aiayn.serve.scheduler import CacheOp, StepPlan


class Runner:
    """``model`` over a cache laid out by ``plan`` (fixed slots or paged blocks)."""

    def __init__(self, model: DecoderOnly, plan: SlotPlan | BlockPlan, *, kv_cache: str | None = None,
                 compile: bool = False) -> None:
        self.model = model
        self.device = model_device(model)
        self.cache: KVCache  # per row, or a PagedKVCache
        if isinstance(plan, BlockPlan):
            self.cache = model.new_cache(plan.rows, plan.context, per_row=True, quantize=kv_cache,
                                         n_blocks=plan.n_blocks, block_size=plan.block_size)  # type: ignore[assignment]
        else:
            self.cache = model.new_cache(plan.rows, plan.context, per_row=True, quantize=kv_cache)  # type: ignore[assignment]
        self.compiled = CompiledRows(model, self.cache) if compile else None  # type: ignore[arg-type]

    def apply(self, ops: list[CacheOp]) -> None:
        """Do the scheduler's cache operations, in order: the fixed slots' ``ops``; a paged cache's
        device state follows the row moves the scheduler made on its block tables."""
        cache = self.cache
        if isinstance(cache, PagedKVCache):
            cache.follow()
        for op in ops:
            if op[0] == "swap":
                cache.swap_rows(op[1], op[2])
            else:
                cache.clear_row(op[1])

    def forward(self, plan: StepPlan) -> Tensor:
        """``plan``'s forward -> the logits (m, v) of the rows that sample (``plan.sampled``)."""
        if not plan.prefill and self.compiled is not None:  # (fixed slots only: no blocks to take)
            return self.compiled.step([r.last_token for r in plan.decode])  # (d, v)
        parts = self._prefill_parts(plan) if plan.prefill else []
        at, offset = list(range(len(plan.decode))), len(plan.decode)
        for _, tokens, ends in plan.prefill:
            offset += len(tokens)
            if ends:
                at.append(offset - 1)  # its last token, in the packed tokens
        batches = [self._decode_batch(plan.decode), *parts] if plan.decode else parts
        return decode_ragged(self.model, batches, to_device(torch.tensor(at, dtype=torch.long), self.device))

    def _decode_batch(self, requests: list[Request]) -> RaggedBatch:
        """The decoding rows (the first ``len(requests)``) feeding their last tokens: (d, 1)."""
        tokens = to_device(torch.tensor([[r.last_token] for r in requests], dtype=torch.long), self.device)
        return RaggedBatch(tokens, [1] * len(requests), self.cache.rows(0, len(requests)))

    def _prefill_parts(self, plan: StepPlan) -> list[RaggedBatch]:
        """A part per prefilling row, (1, take) over its own one-row view of the cache."""
        ids = [token for _, tokens, _ in plan.prefill for token in tokens]
        flat = to_device(torch.tensor(ids, dtype=torch.long), self.device)  # (n,)
        parts, offset, start = [], 0, plan.first
        for i, (_, tokens, _) in enumerate(plan.prefill):
            take = len(tokens)
            parts.append(RaggedBatch(flat[offset: offset + take][None], [take], self.cache.rows(start + i, start + i + 1)))
            offset += take
        return parts
