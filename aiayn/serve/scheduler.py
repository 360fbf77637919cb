"""The serve engine's scheduler: which requests hold rows and what each forward feeds, as a
``StepPlan`` of host numbers that the runner applies and runs.

Cache row i serves ``rows[i]``: decoding rows first, then prefilling ones (kept so by swaps, so both
are contiguous views). Each step cancelled requests leave, waiting ones take free rows in arrival
order (paged: by free blocks, preempting the newest when short), and the prefilling rows share
``prefill_chunk`` prompt tokens (``prefill_plan``), fed in the decoding rows' forward; with no row
decoding yet, or ``compiled`` decode graphs, the chunk runs alone and a decode forward follows."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiayn.serve.blocks import BlockScheduler
from aiayn.serve.request import Request

# ("swap", i, j) or ("clear", row) for the fixed slots' cache, run by the runner in order; a paged
# cache's (and its ("adopt", row, blocks)) go to its block tables as planned.
CacheOp = tuple


def prefill_plan(remaining: Sequence[int], chunk: int) -> list[tuple[int, int]]:
    """This step's prefill as ``(index into remaining, tokens it feeds)``: fewest tokens left first,
    each row taking what is left of the ``chunk`` budget, so a short prompt beside a long one
    starts at the next step. ``remaining``: each prefilling row's prompt tokens still to feed."""
    if chunk < 1 or min(remaining, default=1) < 1:
        raise ValueError(f"a prefill plan needs chunk >= 1 and rows with tokens to feed, got {chunk}, {list(remaining)}")
    plan, budget = [], chunk
    for i in sorted(range(len(remaining)), key=lambda i: (remaining[i], i)):  # fewest left first, then row order
        if budget == 0:
            break
        take = min(remaining[i], budget)
        plan.append((i, take))
        budget -= take
    return plan


@dataclass
class StepPlan:
    """One forward: ``decode`` rows [0, d) feed their last tokens, ``prefill`` rows [first, first + k)
    feed (request, tokens, whether its prompt ends here)."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, list[int], bool]] = field(default_factory=list)
    first: int = 0
    ops: list[CacheOp] = field(default_factory=list)  # the fixed slots' cache operations, before the forward
    register: list[tuple[Request, list[bytes]]] = field(default_factory=list)  # digests to index after it
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # back in the queue
    decode_next: bool = False  # a second, decode-only forward follows in this step

    @property
    def runs(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def sampled(self) -> list[Request]:
        """The rows that choose a token from this forward, in its logits' order."""
        return [*self.decode, *(r for r, _, ends in self.prefill if ends)]


class Scheduler:
    """The engine's rows, queue and plans. ``waiting`` is shared with the submitting threads:
    read and changed under ``lock``."""

    def __init__(self, max_batch: int, prefill_chunk: int, lock: threading.Condition,
                 blocks: BlockScheduler | None = None, compiled: bool = False) -> None:
        self.max_batch, self.prefill_chunk, self.lock = max_batch, prefill_chunk, lock
        self.blocks = blocks  # the paged cache's bookkeeping (None: fixed slots)
        self.compiled = compiled
        self.rows: list[Request] = []  # cache row i serves rows[i]: decoding first, then prefilling
        self.n_decode = 0
        self.waiting: deque[Request] = deque()

    def sequence(self, request: Request) -> list[int]:
        """What ``request``'s row must hold before it samples (after a preemption: also its answer so far)."""
        return self.blocks.sequence(request) if self.blocks is not None else request.prompt

    # ---- a step's plan --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """This step's first forward, with the cache operations that make its rows."""
        plan = StepPlan()
        for request in [r for r in self.rows if r.cancelled]:
            self._remove(request, plan.ops)
        self._admit(plan)
        if self.blocks is not None:
            self._make_room(self.blocks, plan)
        if len(self.rows) > self.n_decode:
            mixed = bool(self.n_decode) and not self.compiled
            plan.decode = self._decoding() if mixed else []
            self._chunk(plan)
            plan.decode_next = not mixed
        elif self.n_decode:
            plan.decode = self._decoding()
        return plan

    def decode_plan(self) -> StepPlan:
        """The step's second forward, after a chunk that ran alone: every decoding row."""
        return StepPlan(decode=self._decoding())

    def update(self, plan: StepPlan, finished: list[Request]) -> list[CacheOp]:
        """After ``plan``'s forward: the rows whose prompt it ended join the decoding rows, in
        order, and the ``finished`` requests leave. The cache operations that follow."""
        ops: list[CacheOp] = []
        if self.blocks is not None:  # the full blocks of prompts are indexed as soon as they are computed
            for request, digests in plan.register:
                self.blocks.tables.register(self.rows.index(request), digests)
        for request, _, ends in plan.prefill:
            if ends:
                self._swap(self.rows.index(request), self.n_decode, ops)
                self.n_decode += 1
        for request in finished:
            self._remove(request, ops)
        return ops

    def reset(self) -> list[Request]:
        """Every request waiting or running is dropped (the cache is reset): returned."""
        with self.lock:
            pending = [*self.rows, *self.waiting]
            self.waiting.clear()
        self.rows.clear()
        self.n_decode = 0
        return pending

    def _decoding(self) -> list[Request]:
        requests = self.rows[: self.n_decode]
        if self.blocks is not None:
            for request in requests:
                self.blocks.decoding(request)
        return requests

    def _chunk(self, plan: StepPlan) -> None:
        """The prefill chunk, moved to the first prefilling rows in its order; its tokens counted as fed."""
        pending = self.rows[self.n_decode:]
        plan.first, now = self.n_decode, time.monotonic()
        for slot, (index, take) in enumerate(prefill_plan(self._remaining(pending), self.prefill_chunk)):
            request = pending[index]
            self._swap(self.rows.index(request), self.n_decode + slot, plan.ops)
            sequence = self.sequence(request)
            tokens = sequence[request.fed: request.fed + take]
            request.prefill_at = request.prefill_at or now
            request.fed += take
            plan.prefill.append((request, tokens, request.fed == len(sequence)))
            digests = self.blocks.digests(request) if self.blocks is not None else None
            if digests is not None:
                plan.register.append((request, digests))

    def _remaining(self, requests: list[Request]) -> list[int]:
        return [len(self.sequence(r)) - r.fed for r in requests]

    # ---- admission ------------------------------------------------------------------------------
    def _admit(self, plan: StepPlan) -> None:
        """Waiting requests take free rows in arrival order; paged, while ``BlockScheduler.admission``
        says so (one waiting for a prefilling row's blocks, the same prompt with n > 1, lets others pass)."""
        blocks = self.blocks
        with self.lock:
            candidates = list(self.waiting)
        if blocks is not None:
            blocks.prune({r.id for r in [*candidates, *self.rows]})
        for request in candidates:
            if len(self.rows) >= self.max_batch:
                return
            verdict = "admit" if request.cancelled or blocks is None else blocks.admission(
                request, self.rows, self.n_decode)
            if verdict == "full":
                return
            if verdict == "wait":
                continue
            with self.lock:
                if request not in self.waiting:  # cancelled meanwhile
                    continue
                self.waiting.remove(request)
            if request.cancelled:
                if blocks is not None:
                    blocks.forget(request)
                continue
            if blocks is None or request.id not in blocks.resumed:  # (a preempted one keeps its text, draws)
                plan.admitted.append(request)
            self._do(("clear", len(self.rows)), plan.ops)
            if blocks is not None:
                self._do(("adopt", len(self.rows), blocks.start(request)), plan.ops)
            self.rows.append(request)
            request.admitted_at = request.admitted_at or time.monotonic()

    def _make_room(self, blocks: BlockScheduler, plan: StepPlan) -> None:
        """Preempt the newest requests until this step's forwards have the blocks they need (the
        oldest request alone always fits: ``BlockScheduler.check_fits``)."""
        tables = blocks.tables
        while self.rows:
            need = sum(tables.blocks_for(row, 1) for row in range(self.n_decode))
            # With no row decoding yet, a row whose prompt ends in the chunk also decodes this step.
            joins = not self.n_decode
            remaining = self._remaining(self.rows[self.n_decode:])
            need += sum(tables.blocks_for(self.n_decode + i, take + (joins and take == remaining[i]))
                        for i, take in prefill_plan(remaining, self.prefill_chunk))
            if need <= tables.pool.available:
                return
            victim = blocks.newest(self.rows)
            decoding = self.rows.index(victim) < self.n_decode
            self._free_row(victim, plan.ops)
            blocks.preempted(victim, decoding)
            plan.preempted.append(victim)
            with self.lock:
                self.waiting.appendleft(victim)

    # ---- leaving ---------------------------------------------------------------------------------
    def _remove(self, request: Request, ops: list[CacheOp]) -> None:
        self._free_row(request, ops)
        if self.blocks is not None:
            self.blocks.forget(request)
        request.finished = True

    def _free_row(self, request: Request, ops: list[CacheOp]) -> None:
        """Free ``request``'s row: moved to the end of the used rows (keeping both parts' order) and
        cleared (a paged row's blocks go back at once)."""
        row = self.rows.index(request)
        if row < self.n_decode:
            self._swap(row, self.n_decode - 1, ops)
            row = self.n_decode = self.n_decode - 1
        for k in range(row, len(self.rows) - 1):
            self._swap(k, k + 1, ops)
        self._do(("clear", len(self.rows) - 1), ops)
        self.rows.pop()

    def _swap(self, i: int, j: int, ops: list[CacheOp]) -> None:
        if i != j:
            self._do(("swap", i, j), ops)
            self.rows[i], self.rows[j] = self.rows[j], self.rows[i]

    def _do(self, op: CacheOp, ops: list[CacheOp]) -> None:
        """A cache operation, planned: for the fixed slots, listed in ``ops`` for the runner; for a
        paged cache, done now on its host block tables (the runner has the device follow)."""
        if self.blocks is None:
            ops.append(op)
        elif op[0] == "swap":
            self.blocks.tables.swap(op[1], op[2])
        elif op[0] == "clear":
            self.blocks.tables.clear(op[1])
        else:
            self.blocks.tables.adopt(op[1], op[2])
