"""The serve engine's KV-cache plans (``slot_plan``, ``block_plan`` from ``--kv-budget``) and the
paged cache's bookkeeping (``BlockScheduler``).

* Admission: a request starts when a row is free and the pool holds its whole prompt (after
  prefix hits) beside what admitted prompts still need.
* Prefix cache (vLLM's): a new request holds the longest indexed prefix (never its last
  token's block); the choices of one request share one prefill.
* Preemption (recompute): the newest request gives its blocks back when the next forward needs
  more; the oldest always fits alone, so the engine never deadlocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiayn.nn.block_pool import block_digests
from aiayn.nn.block_tables import BlockTables
from aiayn.nn.kv_memory import QUANTIZED, format_bytes, kv_cache_bytes

if TYPE_CHECKING:
    from aiayn.serve.request import Request
    from aiayn.textgen import TextModel

DEFAULT_BLOCK_SIZE = 16
PAGED_COMPILE = ("--compile works with --kv-layout slots only (the paged cache's decode step is not "
                 "compiled yet); use --kv-layout slots")


@dataclass(frozen=True)
class SlotPlan:
    """How the KV cache memory is laid out: ``rows`` fixed slots of ``context`` tokens each."""

    rows: int
    context: int
    bytes_per_row: int
    dtype: str

    def describe(self, budget: int) -> str:
        return (f"KV cache: {self.rows} slots x {self.context} tokens ({self.dtype}), "
                f"{format_bytes(self.rows * self.bytes_per_row)} of a {format_bytes(budget)} budget "
                f"({format_bytes(self.bytes_per_row)} per slot) -> up to {self.rows} concurrent requests")


def _bytes_per(lm: TextModel, context: int, kv_cache: str | None, tokens: int) -> tuple[str, int]:
    """The cache's dtype and the bytes ``tokens`` tokens of one row take; ValueError past the model's context."""
    config = lm.model.config
    if context > lm.context:
        raise ValueError(f"a context of {context} tokens is more than the model's {lm.context}; give at most that")
    dtype = kv_cache or str(lm.model.float_dtype).removeprefix("torch.")
    return dtype, kv_cache_bytes(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                                 seq_len=tokens, batch_size=1, dtype=dtype)


def slot_plan(lm: TextModel, *, max_batch: int, context: int, budget: int, kv_cache: str | None) -> SlotPlan:
    """``max_batch`` slots of ``context`` tokens, fewer if ``budget`` bytes do not hold them; ValueError
    if not even one fits or ``context`` exceeds the model's."""
    dtype, per_row = _bytes_per(lm, context, kv_cache, context)
    rows = min(max_batch, budget // per_row)
    if rows < 1:
        raise ValueError(f"one request of {context} tokens needs {format_bytes(per_row)} of KV cache, more than "
                         f"the budget of {format_bytes(budget)}; raise the budget or lower the context")
    return SlotPlan(rows, context, per_row, dtype)


@dataclass(frozen=True)
class BlockPlan:
    """``n_blocks`` blocks (null block included) of ``block_size`` tokens for ``rows`` rows of ``context``."""

    rows: int
    context: int
    n_blocks: int
    block_size: int
    bytes_per_block: int
    dtype: str
    prefix_caching: bool = True

    @property
    def capacity_tokens(self) -> int:
        """Tokens the usable blocks hold (the null block excluded): the most one request may use."""
        return (self.n_blocks - 1) * self.block_size

    def describe(self, budget: int) -> str:
        return (f"KV cache (paged): {self.n_blocks - 1} blocks x {self.block_size} tokens ({self.dtype}), "
                f"{format_bytes(self.n_blocks * self.bytes_per_block)} of a {format_bytes(budget)} budget "
                f"({format_bytes(self.bytes_per_block)} per block) -> {self.capacity_tokens} tokens shared by up to "
                f"{self.rows} concurrent requests; prefix caching {'on' if self.prefix_caching else 'off'}")


def block_plan(lm: TextModel, *, max_batch: int, context: int, budget: int, kv_cache: str | None,
               block_size: int = DEFAULT_BLOCK_SIZE, prefix_caching: bool = True) -> BlockPlan:
    """A pool of blocks in ``budget`` bytes for ``max_batch`` rows of up to ``context`` tokens;
    ValueError for a quantised cache, a context over the model's, or fewer than two blocks."""
    if kv_cache in QUANTIZED:
        raise ValueError(f"--kv-cache {kv_cache} needs --kv-layout slots: the paged KV cache holds float keys "
                         f"and values")
    if block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {block_size}")
    dtype, per_block = _bytes_per(lm, context, kv_cache, block_size)
    most = 1 + max_batch * -(-context // block_size)  # what max_batch full rows could hold, + the null block
    n_blocks = min(most, budget // per_block)
    if n_blocks < 2:
        raise ValueError(f"two blocks of {block_size} tokens (one is the null block) need {format_bytes(2 * per_block)} "
                         f"of KV cache, more than the budget of {format_bytes(budget)}; raise the budget or lower "
                         f"the block size")
    return BlockPlan(max_batch, context, n_blocks, block_size, per_block, dtype, prefix_caching)


class BlockScheduler:
    """The paged cache's bookkeeping per request: what its row must hold, its prompt's digests, prefix
    hits, the order of admission (preemption takes the newest) and the hit counters; it changes
    ``tables`` as it plans, and the cache's device state follows."""

    def __init__(self, tables: BlockTables, plan: BlockPlan) -> None:
        self.tables, self.plan = tables, plan
        self.block_size = plan.block_size
        self._sequence: dict[int, list[int]] = {}  # request id -> the tokens its row must hold
        self._digests: dict[int, list[bytes]] = {}
        self._decoded: dict[int, list[int]] = {}  # request id -> answer tokens fed since its prefill
        self._admitted: dict[int, int] = {}  # request id -> admission number (newest: highest)
        self._admissions = 0
        self.resumed: set[int] = set()  # requests preempted at least once (back in the queue)
        self.hit_tokens = 0  # prompt tokens found in the prefix cache (not recomputed)
        self.looked_up_tokens = 0  # prompt tokens of admitted requests

    # ---- admission ----------------------------------------------------------------------------
    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """ValueError, the limit named, for a request the pool could never hold."""
        total = prompt_tokens + max_tokens
        if total > self.plan.capacity_tokens:
            raise ValueError(f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} = {total} tokens exceed the "
                             f"KV cache's {self.plan.capacity_tokens} tokens ({self.plan.n_blocks - 1} blocks of "
                             f"{self.block_size}; raise --kv-budget)")

    def sequence(self, request: Request) -> list[int]:
        """The tokens ``request``'s row must hold before it samples (after a preemption: also its answer)."""
        return self._sequence.get(request.id, request.prompt)

    def _hits(self, request: Request) -> tuple[list[bytes], list[int]]:
        """The request's digests and the indexed blocks it can hold (never the one with its last token)."""
        if not self.plan.prefix_caching:
            return [], []
        sequence = self.sequence(request)
        # Kept from admission on; a waiting request's are made anew each time (it may never come).
        digests = self._digests.get(request.id) or block_digests(sequence, self.block_size)
        return digests, self.tables.pool.lookup(digests)[: (len(sequence) - 1) // self.block_size]

    def admission(self, request: Request, rows: Sequence[Request], n_decode: int) -> str:
        """"admit", "wait" (a prefilling row computes its next block: n > 1) or "full" (the pool
        cannot hold its prompt beside what the cache's ``rows`` still need: the first ``n_decode``
        decoding, the others prefilling)."""
        digests, hits = self._hits(request)
        prefilling = rows[n_decode:]
        if len(hits) < len(digests):
            upcoming = digests[len(hits)]
            if any(upcoming in self._digests.get(other.id, ()) for other in prefilling):
                return "wait"
        tables, pool = self.tables, self.tables.pool
        still_needed = sum(tables.blocks_for(n_decode + k, len(self.sequence(other)) - other.fed)
                           for k, other in enumerate(prefilling))
        still_needed += sum(tables.blocks_for(row, 1) for row in range(n_decode))
        own = -(-len(self.sequence(request)) // self.block_size) - len(hits)
        cached_hits = sum(1 for block in hits if pool.refs(block) == 0)  # evictable now, held once admitted
        return "admit" if own + still_needed <= pool.available - cached_hits else "full"

    def start(self, request: Request) -> list[int]:
        """``request`` takes an empty row: the prefix hits it holds (the scheduler has the row adopt them)."""
        digests, hits = self._hits(request)
        if self.plan.prefix_caching:
            self._digests[request.id] = digests
        request.fed = len(hits) * self.block_size
        if request.id not in self.resumed:
            self.hit_tokens += request.fed
            self.looked_up_tokens += len(request.prompt)
        self._admissions += 1
        self._admitted[request.id] = self._admissions
        return hits

    def digests(self, request: Request) -> list[bytes] | None:
        """What ``request``'s full blocks are indexed under after a prefill forward (None: no prefix cache)."""
        return list(self._digests.get(request.id, ())) if self.plan.prefix_caching else None

    # ---- running rows -------------------------------------------------------------------------
    def decoding(self, request: Request) -> None:
        """``request`` feeds its last token now (a decode step): remembered for a recompute."""
        self._decoded.setdefault(request.id, []).append(request.last_token)

    def newest(self, requests: Sequence[Request]) -> Request:
        return max(requests, key=lambda r: self._admitted.get(r.id, 0))

    def preempted(self, request: Request, decoding: bool) -> None:
        """``request`` gave its row back: next time its row must hold everything it has so far."""
        if decoding:
            self._sequence[request.id] = [*self.sequence(request), *self._decoded.pop(request.id, []),
                                          request.last_token]
            self._digests.pop(request.id, None)
        request.fed = 0
        self.resumed.add(request.id)
        self._admitted.pop(request.id, None)

    def forget(self, request: Request) -> None:
        for table in (self._sequence, self._digests, self._decoded, self._admitted):
            table.pop(request.id, None)
        self.resumed.discard(request.id)

    def prune(self, live: set[int]) -> None:
        """Drop what is kept for requests not in ``live`` (ids of those waiting or running)."""
        if len(self.resumed) + len(self._admitted) > len(live):
            for table in (self._sequence, self._digests, self._decoded, self._admitted):
                for gone in table.keys() - live:
                    del table[gone]
            self.resumed &= live

    @property
    def hit_rate(self) -> float:
        """Share of admitted prompt tokens found in the prefix cache."""
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0
