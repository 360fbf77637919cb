"""The serve engine's decode step as compiled graphs, one per batch-size bucket (``aiayn serve --compile``).

A graph has static shapes, so the n decoding rows (the cache's first rows) run on the smallest
bucket that holds them (1, 2, 4, ... and ``max_batch``). Padding rows [n, bucket) feed token 0
recorded as invalid at their own next slot, which a prefill or a new request writes again before
anything reads it. Attention runs over each row's whole buffer under its validity mask
(``compiled_row_step``), so each bucket compiles once, then replays (on CUDA as a CUDA graph, the
cache's buffers static). The host bookkeeping (``next_token_slots``, ``KVCache.expect``) reads
nothing back from the device. Results equal the eager engine's up to float rounding
(tests/serve/test_compiled_engine.py)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from aiayn.device import to_device
from aiayn.fast.compiled_decode import compiled_row_step, mark_static, next_token_slots
from aiayn.models.decoder_only import DecoderOnly
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.paged_kv_cache import PagedKVCache
from aiayn.serve.blocks import PAGED_COMPILE

logger = logging.getLogger("aiayn.serve")
COMPILE_NEEDS_FLOAT = "--compile needs a float KV cache in fixed slots: use --kv-cache float and --kv-layout slots"


def compile_refusal(kv_layout: str | None, kv_cache: str | None) -> str | None:
    """Why ``--compile`` cannot serve with these cache options (one line for the user), or None."""
    if kv_layout == "paged":
        return PAGED_COMPILE
    return COMPILE_NEEDS_FLOAT if kv_cache not in (None, "float") else None


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: powers of two below ``max_batch``, then ``max_batch``."""
    powers = [1 << k for k in range((max_batch - 1).bit_length())]  # 1, 2, 4, ... below max_batch
    return [*powers, max_batch]


class CompiledRows:
    """Decode steps of ``model`` over the first rows of ``cache`` through one compiled graph per
    bucket (see the module docstring). ``compiled_buckets``: the buckets that have run."""

    def __init__(self, model: DecoderOnly, cache: KVCache) -> None:
        if not cache.per_row or isinstance(cache, PagedKVCache) or cache.quantize is not None:
            raise ValueError(COMPILE_NEEDS_FLOAT)
        self.model, self.cache = model, cache
        self.buckets = bucket_sizes(cache.batch_size)
        # Per bucket, a view of the cache's first rows, kept so a CUDA graph sees the same buffers at
        # every replay (views share the cache's storage).
        self._views: dict[int, KVCache] = {}
        self.compiled_buckets: set[int] = set()

    def bucket(self, n: int) -> int:
        if n > self.buckets[-1]:
            raise ValueError(f"{n} rows exceed the cache's {self.buckets[-1]}")
        return next(size for size in self.buckets if size >= n)

    def _view(self, size: int) -> KVCache:
        """Rows [0, size) of the cache: the graph reads its masks and its layers store each row's new
        key in place (``Slots.row_slot``)."""
        if size not in self._views:
            view = self.cache.rows(0, size)
            if view.valid.device.type == "cuda":
                mark_static(view.valid, view.positions, *[t for layer in view.layers for t in (layer.k, layer.v)])
            self._views[size] = view
        return self._views[size]

    def step(self, last_tokens: list[int]) -> Tensor:
        """Rows [0, n) feed their last tokens, ``last_tokens`` (n ints) -> their next-token logits (n, v)."""
        n = len(last_tokens)
        size = self.bucket(n)
        view = self._view(size)
        host_tokens = torch.zeros(size, 1, dtype=torch.long)  # (size, 1): padding rows feed token 0
        host_tokens[:n, 0] = torch.tensor(last_tokens, dtype=torch.long)
        tokens, live = to_device((host_tokens, torch.arange(size) < n), view.valid.device)  # (size, 1), (size,)
        # Rows [0, n) bring one real token each, the padding rows none (their slot recorded invalid).
        positions, slots = next_token_slots(self.model, view.expect([1] * n + [0] * (size - n)), live[:, None])
        if size not in self.compiled_buckets:
            logger.info("compiling the decode step for %d row(s) (once per batch-size bucket)", size)
            self.compiled_buckets.add(size)
        if view.valid.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed: reuse them
        logits = compiled_row_step(self.model, tokens, positions, slots, view.valid, view.positions, view)
        return logits[:n]  # (n, v)
