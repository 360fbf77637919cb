"""The serve engine's scheduler: which requests hold rows, and what each forward feeds. It keeps
host numbers only and returns a plan (``StepPlan``); the runner (``aiayn.serve.runner``) applies
the plan's cache operations and runs it.

Cache row i serves ``rows[i]``: the decoding rows first, then the prefilling ones, kept in that
order by swapping rows as requests join and leave, so both parts run on contiguous views of the
cache with no copy. Every step (``schedule``):

1. cancelled requests (a client gone, a stop string seen) give their row back at once;
2. waiting requests take free rows in arrival order (the paged cache: by free blocks, prefix
   hits, and ``aiayn.serve.blocks`` for the rules);
3. the paged cache: the newest requests are preempted (recomputed later) until the step's
   forwards have the blocks they need;
4. **prefill**, in chunks: the prefilling rows feed up to ``prefill_chunk`` prompt tokens between
   them, fewest tokens left first (``aiayn.serve.schedule``), moved to the first prefilling rows
   in that order. A long prompt thus takes several steps, the other streams get a token at each
   of them, and a short prompt arriving meanwhile is not held behind it;
5. **decode**: every decoding row feeds its last token. When a step has both, the decoding rows
   and the prefill chunk go through **one forward** (the weights read once, as vLLM's chunked
   prefill batches them); a row whose prompt ends in the chunk decodes from the next step. With
   no row decoding yet (or ``compiled``: decode steps are compiled graphs, prefill is eager), the
   chunk runs alone and the rows it finishes decode in a second forward of the same step
   (``decode_plan``).

After each forward (``update``) the rows whose prompt is done join the decoding rows and the
finished requests leave.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from aiayn.serve.blocks import BlockScheduler
from aiayn.serve.request import Request
from aiayn.serve.schedule import prefill_plan

# What the runner does to the cache, in order: ("swap", i, j), ("clear", row), ("adopt", row,
# blocks) before a forward; ("register", row, digests) after it (the prefix index).
CacheOp = tuple


@dataclass
class StepPlan:
    """One forward: ``decode`` feed their last tokens (rows [0, d)); ``prefill`` rows [first,
    first + k) feed (request, tokens, whether its prompt ends here); ``ops`` go to the cache
    first, ``register`` after. ``admitted``: new requests (their text and draws to set up);
    ``preempted``: back in the queue, their blocks given back; ``freed``: cancelled, their rows
    freed; ``decode_next``: the chunk runs alone and the decoding rows decode in a second forward
    of this step."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, list[int], bool]] = field(default_factory=list)
    first: int = 0
    ops: list[CacheOp] = field(default_factory=list)
    register: list[CacheOp] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    freed: list[Request] = field(default_factory=list)
    decode_next: bool = False

    @property
    def runs(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def sampled(self) -> list[Request]:
        """The rows that choose a token from this forward, in its logits' order."""
        return [*self.decode, *(r for r, _, ends in self.prefill if ends)]


class Scheduler:
    """Rows, queue and plans of the engine (see the module docstring). ``waiting`` is shared with
    the threads that submit: it is read and changed under ``lock``."""

    def __init__(self, max_batch: int, prefill_chunk: int, lock: threading.Condition,
                 blocks: BlockScheduler | None = None, compiled: bool = False) -> None:
        self.max_batch, self.prefill_chunk, self.lock = max_batch, prefill_chunk, lock
        self.blocks = blocks  # the paged cache's bookkeeping (None: fixed slots)
        self.compiled = compiled
        self.rows: list[Request] = []  # cache row i serves rows[i]: decoding first, then prefilling
        self.n_decode = 0
        self.waiting: deque[Request] = deque()

    def sequence(self, request: Request) -> list[int]:
        """What ``request``'s row must hold before it samples: its prompt (after a preemption, its
        prompt and answer so far)."""
        return self.blocks.sequence(request) if self.blocks is not None else request.prompt

    # ---- a step's plan --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """This step's first forward, with the cache operations that make its rows."""
        plan = StepPlan()
        if self.blocks is not None:
            self.blocks.snapshot(self.rows)
        plan.freed = [r for r in self.rows if r.cancelled]
        for request in plan.freed:
            self._remove(request, plan.ops)
        if self.blocks is not None:
            self._admit_by_blocks(self.blocks, plan)
            self._make_room(self.blocks, plan)
        else:
            self._admit(plan)
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
        """The prefill chunk (``prefill_plan``), moved to the first prefilling rows in its order;
        its tokens counted as fed."""
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
            if digests is not None:  # the full blocks of prompts are indexed as soon as they are computed
                plan.register.append(("register", self.n_decode + slot, digests))

    def _remaining(self, requests: list[Request]) -> list[int]:
        return [len(self.sequence(r)) - r.fed for r in requests]

    # ---- admission ------------------------------------------------------------------------------
    def _admit(self, plan: StepPlan) -> None:
        """Fixed slots: waiting requests take free rows in arrival order."""
        while len(self.rows) < self.max_batch:
            with self.lock:
                if not self.waiting:
                    return
                request = self.waiting.popleft()
            if request.cancelled:
                continue
            plan.admitted.append(request)
            plan.ops.append(("clear", len(self.rows)))
            self.rows.append(request)
            request.admitted_at = time.monotonic()

    def _admit_by_blocks(self, blocks: BlockScheduler, plan: StepPlan) -> None:
        """The paged cache's admission, in arrival order: a request starts when a row is free and the
        pool holds its prompt (``BlockScheduler.admission``); one that waits for a prefilling row's
        blocks (the same prompt: n > 1) lets the others pass."""
        with self.lock:
            candidates = list(self.waiting)
        blocks.prune({r.id for r in [*candidates, *self.rows]})
        for request in candidates:
            if len(self.rows) >= self.max_batch:
                return
            verdict = "skip" if request.cancelled else blocks.admission(
                request, self.rows[self.n_decode:], self.rows[: self.n_decode])
            if verdict == "full":
                return
            if verdict == "wait":
                continue
            with self.lock:
                if request not in self.waiting:  # cancelled meanwhile
                    continue
                self.waiting.remove(request)
            if request.cancelled:
                blocks.forget(request)
                continue
            if request.id not in blocks.resumed:  # (a preempted request keeps its text and draws)
                plan.admitted.append(request)
            plan.ops += [("clear", len(self.rows)), ("adopt", len(self.rows), blocks.start(request))]
            self.rows.append(request)
            request.admitted_at = request.admitted_at or time.monotonic()

    def _make_room(self, blocks: BlockScheduler, plan: StepPlan) -> None:
        """Preempt the newest requests until this step's forwards have the blocks they need (the
        oldest request alone always fits: ``BlockScheduler.check_fits``)."""
        while self.rows:
            need = sum(blocks.blocks_for(r, 1) for r in self.rows[: self.n_decode])
            # With no row decoding yet, a row whose prompt ends in this step's chunk decodes in the
            # same step: its chunk and that one token. (Else the rows decoding now decode beside the
            # chunk, and the ones it finishes start next step.)
            joins = not self.n_decode
            pending = self.rows[self.n_decode:]
            remaining = self._remaining(pending)
            need += sum(blocks.blocks_for(pending[i], take + (joins and take == remaining[i]))
                        for i, take in prefill_plan(remaining, self.prefill_chunk))
            if need <= blocks.available:
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
        """``request`` is done: free its row."""
        self._free_row(request, ops)
        if self.blocks is not None:
            self.blocks.forget(request)
        request.finished = True

    def _free_row(self, request: Request, ops: list[CacheOp]) -> None:
        """Free ``request``'s row: it moves to the end of the used rows (decoding rows stay first,
        prefilling ones keep their order) and is cleared (a paged row's blocks go back at once)."""
        row = self.rows.index(request)
        if row < self.n_decode:
            self._swap(row, self.n_decode - 1, ops)
            row = self.n_decode = self.n_decode - 1
        for k in range(row, len(self.rows) - 1):
            self._swap(k, k + 1, ops)
        ops.append(("clear", len(self.rows) - 1))
        if self.blocks is not None:
            self.blocks.let_go(request)
        self.rows.pop()

    def _swap(self, i: int, j: int, ops: list[CacheOp]) -> None:
        if i != j:
            ops.append(("swap", i, j))
            self.rows[i], self.rows[j] = self.rows[j], self.rows[i]
