"""The serve engine's runner: the model, its KV cache and the forwards. It applies a step plan's
cache operations and runs the plan as one ``decode_ragged`` call: the decoding rows' last tokens,
(d, 1), and a part per prefilling row, (1, take) over its own one-row view of the cache; one read
of the weights, no padding, nothing read back from the device. Shapes: m positions whose logits
are wanted, v vocabulary."""

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
from aiayn.serve.scheduler import CacheOp, StepPlan


class Runner:
    """``model`` over a cache laid out by ``plan`` (fixed slots or paged blocks)."""

    def __init__(self, model: DecoderOnly, plan: SlotPlan | BlockPlan, *, kv_cache: str | None = None,
                 compile: bool = False) -> None:
        self.model = model
        self.device = model_device(model)
        paged = ({"n_blocks": plan.n_blocks, "block_size": plan.block_size} if isinstance(plan, BlockPlan)
                 else {})
        self.cache: KVCache = model.new_cache(plan.rows, plan.context, per_row=True, quantize=kv_cache,
                                              **paged)  # per row, or a PagedKVCache
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
        d = len(plan.decode)
        batches, at = [], list(range(d))
        if plan.decode:
            last = torch.tensor([[r.last_token] for r in plan.decode], dtype=torch.long)  # (d, 1)
            batches.append(RaggedBatch(to_device(last, self.device), [1] * d, self.cache.rows(0, d)))
        ids = torch.tensor([token for _, tokens, _ in plan.prefill for token in tokens], dtype=torch.long)
        flat = to_device(ids, self.device) if plan.prefill else ids  # (n - d,)
        offset = 0
        for row, (_, tokens, ends) in enumerate(plan.prefill, plan.first):
            take = len(tokens)
            part = flat[offset: offset + take][None]  # (1, take)
            batches.append(RaggedBatch(part, [take], self.cache.rows(row, row + 1)))
            offset += take
            if ends:
                at.append(d + offset - 1)  # its last token, in the packed tokens
        return decode_ragged(self.model, batches, to_device(torch.tensor(at, dtype=torch.long), self.device))
