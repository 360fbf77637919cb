"""The engine behind ``aiayn serve``: continuous batching of decoder-only generation.

One thread owns the model and a ``RowKVCache`` of ``max_batch`` rows (fixed slots, each as long
as the served context; see ``slot_plan`` for the memory budget). Every step:

1. cancelled requests (a client gone, a stop string seen) give their row back at once;
2. waiting requests take free rows, in arrival order;
3. **prefill**, in chunks: the rows still reading their prompts feed up to ``prefill_chunk``
   prompt tokens between them, fewest tokens left first (``aiayn.serve.schedule``), each row a
   part of its own (no padding) over its one-row view of the cache; a row whose prompt is
   done samples its first token there and joins the decoding rows. A long prompt thus takes
   several steps, the other streams get a token at each of them, and a short prompt arriving
   meanwhile is not held behind it;
4. **decode**: every decoding row feeds its last token and samples its next one; a row that
   finishes (end-of-text, ``max_tokens``, a stop string) leaves at once. When a step has both
   (``mixed_steps``, the default), the decoding rows' tokens and the prefill chunk go through **one
   forward** (``aiayn.generate.step.decode_ragged``: the real tokens of both packed together, one
   read of the weights, each part attending over its own view of the cache, as vLLM's chunked
   prefill batches them); a row whose prompt ends in the chunk decodes from the next step. Else a
   prefill forward, then a decode forward that such a row joins at once;
5. **embeddings**, in slices: the queued ``/v1/embeddings`` jobs (``aiayn.serve.embedding``) run
   forwards of at most ``embed_chunk`` tokens, in turn (one forward per job, round robin), for as
   long as the step's stream forwards took, times ``embed_share / (1 - embed_share)`` (a credit
   carried from step to step: a forward longer than a decode step is paid back over the next
   steps). So embeddings take at most ``embed_share`` of the engine's time while streams run (at
   0.5 a stream's tokens come at most twice as far apart), and all of it when none does.

The cache rows are kept in that order (decoding rows first, then prefilling ones) by swapping
rows as requests join and leave, so both parts run on contiguous views with no copy. Each row
is computed as if alone (``RowKVCache``: its own slots, positions and mask), so a request's greedy
tokens do not depend on what else is running (up to float rounding of the batched matmuls).

Requests talk to the engine through ``submit`` and a ``sink``: a callable the engine thread calls
with an ``Event`` per generated token (the app hands each to its event loop).

The engine runs where its model is (``aiayn.device.model_device``): the cache, each step's tokens
(built on the CPU, then one copy) and every request's generator are there, and the forwards run
under ``aiayn.device.autocast`` (bfloat16 on CUDA, nothing on the CPU). Nothing is read back from
the device but the chosen ids (with the log-probabilities asked for), once per forward in
``aiayn.serve.sampler.choose``: they must reach the host to be detokenised. The cache's extents are known on
the host (``RowKVCache.host_lengths``; each forward tells it its rows' real tokens, ``expect``), so
on a GPU a step queues its work and waits only for its tokens (tests/serve/test_no_device_reads.py).

With a ``BlockPlan`` (``--kv-layout paged``) the cache is a ``PagedKVCache``: rows hold blocks
from one pool, admission is by free blocks, prompt prefixes are shared, and the newest request is
preempted (recomputed later) when a step needs more blocks than are free (``aiayn.serve.blocks``).

``compile=True`` (``--compile``, fixed slots only) runs the decode steps through a compiled graph
per batch-size bucket (``aiayn.serve.compiled_step``); prefill stays eager.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from aiayn.cpu_share import share_cores
from aiayn.device import autocast, model_device
from aiayn.generate.constrain import ConstraintError, GrammarConstraint
from aiayn.generate.text import IncrementalText
from aiayn.nn.paged_kv_cache import PagedKVCache
from aiayn.nn.row_kv_cache import RowKVCache
from aiayn.serve.blocks import BlockPlan, BlockScheduler, PagedSteps, SlotPlan, slot_plan  # noqa: F401  (slot_plan: imported from here too)
from aiayn.serve.compiled_step import CompiledRows
from aiayn.serve.embedding import DEFAULT_CHUNK, EmbeddingJob, EmbeddingQueue
from aiayn.serve.metrics import Metrics
from aiayn.serve.sampler import RowAdjustments, SamplingParams, TokenLogprob, choose
from aiayn.serve.steps import ForwardSteps
from aiayn.textgen import TextModel

logger = logging.getLogger("aiayn.serve")


@dataclass
class Event:
    """What the engine tells a request: text to show (possibly empty: held back), the token's
    log-probability when asked, and the finish reason ("stop", "length") or an error."""

    text: str
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    error: str | None = None
    token: int | None = None  # the generated token's id (None for an error)


PAGED_COMPILE = ("--compile works with --kv-layout slots only (the paged cache's decode step is not "
                 "compiled yet); use --kv-layout slots")


class QueueFull(Exception):
    """The waiting queue is at its limit; ``retry_after`` seconds is a fair wait."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The engine takes no new requests."""


class EngineFailed(RuntimeError):
    """A step failed (a bug): the work that was running is told so."""


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
        self.text: IncrementalText | None = None  # set by the engine (it knows the tokenizer)
        self.constraint = constraint  # advanced with each token on the engine thread
        self.adjustments: RowAdjustments | None = None  # bias / penalty tensors, made on the first token

    def release(self) -> None:
        """Drop the per-request state the sampler holds (grammar, device tensors): it has finished."""
        self.constraint = self.adjustments = None


class Engine(ForwardSteps, PagedSteps):
    """Continuous batching over ``lm`` (see the module docstring). ``start()`` runs it on a
    thread; ``submit`` queues a request (``QueueFull`` past ``max_queue`` waiting)."""

    def __init__(self, lm: TextModel, plan: SlotPlan | BlockPlan, *, kv_cache: str | None = None, prefill_chunk: int = 512,
                 max_queue: int = 64, metrics: Metrics | None = None, threads: int | None = None,
                 embed_chunk: int = DEFAULT_CHUNK, embed_share: float = 0.5,
                 clock: Callable[[], float] = time.perf_counter, compile: bool = False,
                 mixed_steps: bool = True) -> None:
        if prefill_chunk < 1 or max_queue < 0 or embed_chunk < 1 or not 0 < embed_share < 1:
            raise ValueError("prefill_chunk and embed_chunk must be >= 1, max_queue >= 0, 0 < embed_share < 1")
        if compile and isinstance(plan, BlockPlan):
            raise ValueError(PAGED_COMPILE)
        self.lm, self.model, self.plan = lm, lm.model, plan
        self._cv = threading.Condition()
        self.device = model_device(self.model)
        self.context, self.max_batch = plan.context, plan.rows
        self.cache: RowKVCache | PagedKVCache
        self.blocks: BlockScheduler | None = None  # the paged cache's scheduling (None: fixed slots)
        if isinstance(plan, BlockPlan):
            self.cache = self.model.new_cache(plan.rows, plan.context, per_row=True, quantize=kv_cache,
                                              n_blocks=plan.n_blocks, block_size=plan.block_size)  # type: ignore[assignment]
            self.blocks = BlockScheduler(self.cache, plan)  # type: ignore[arg-type]
        else:
            self.cache = self.model.new_cache(plan.rows, plan.context, per_row=True, quantize=kv_cache)  # type: ignore[assignment]
        # --compile: the decode steps through a compiled graph per batch-size bucket (fixed slots only)
        self.compiled = CompiledRows(self.model, self.cache) if compile else None  # type: ignore[arg-type]
        self.prefill_chunk, self.max_queue = prefill_chunk, max_queue
        # A step with both decoding and prefilling rows runs them in one forward (False: two, as
        # before; kept for the benchmarks' A/B). Not with --compile: its decode steps are graphs.
        self.mixed_steps = mixed_steps and self.compiled is None
        self.threads = threads  # torch threads of the engine thread (None: as it finds them)
        self.rows: list[Request] = []  # cache row i serves rows[i]: decoding first, then prefilling
        self.n_decode = 0
        self.waiting: deque[Request] = deque()
        self.jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self.embed_chunk = embed_chunk
        self.metrics = metrics or Metrics()
        self.embeddings = EmbeddingQueue(embed_share, clock, self._cv, self.metrics.embedding_tokens.inc)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.metrics.watch(self)

    # ---- the outside: any thread ---------------------------------------------------------------
    def submit(self, request: Request) -> None:
        total = len(request.prompt) + request.params.max_tokens
        if total > self.context:
            raise ValueError(f"{len(request.prompt)} prompt tokens + max_tokens {request.params.max_tokens} "
                             f"exceed the context of {self.context} tokens")
        if self.blocks is not None:
            self.blocks.check_fits(len(request.prompt), request.params.max_tokens)
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self.waiting) >= self.max_queue + max(0, self.max_batch - len(self.rows)):  # slots free soon
                raise QueueFull(self.retry_after())
            self.waiting.append(request)
            self._cv.notify()

    def embed(self, prompts: list[list[int]]) -> EmbeddingJob:
        """Queue the vectors of ``prompts`` (``job.future`` gets them); ``QueueFull`` when as many
        embedding jobs wait as the server holds requests (``max_batch + max_queue``)."""
        job = EmbeddingJob(self.lm, prompts, self.embed_chunk)
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self.embeddings) >= self.max_batch + self.max_queue:
                raise QueueFull(self.retry_after())
            self.embeddings.add(job)
            self._cv.notify()
        return job

    def cancel(self, request: Request) -> None:
        """Stop ``request``: out of the queue at once if it waits, else its row is freed at the
        engine's next step (no more events)."""
        request.cancelled = True
        with self._cv:
            if request in self.waiting:
                self.waiting.remove(request)
            self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the engine thread between two steps (one model user at a time)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            self.jobs.append((fn, future))
            self._cv.notify()
        return future

    def retry_after(self) -> int:
        """Seconds until a queued request would likely start: the queue over the batch, times the
        recent mean request time (at least 1)."""
        mean = self.metrics.mean_request_seconds() or 1.0
        return max(1, min(60, round(mean * (len(self.waiting) + 1) / self.max_batch)))

    @property
    def running(self) -> int:
        return len(self.rows)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="aiayn-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still waiting or running get an error event."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all("the server is shutting down; the request was stopped")

    # ---- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        while True:
            with self._cv:
                while not (self._stopping or self.waiting or self.rows or self.jobs or self.embeddings):
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                share_cores()  # this server's fair share of the cores beside other aiayn jobs (aiayn/cpu_share.py)
                self.step()
            except Exception as exc:  # a bug: fail what is running, keep serving
                logger.exception("engine step failed")
                self._fail_all(f"internal error: {type(exc).__name__}: {exc}")

    def _fail_all(self, message: str) -> None:
        with self._cv:
            pending = [*self.rows, *self.waiting]
            self.waiting.clear()
            jobs = list(self.jobs)
            self.jobs.clear()
        self.embeddings.fail_all(ShuttingDown(message) if self._stopping else EngineFailed(message))
        for request in pending:
            if not request.finished:
                request.finished = True
                request.sink(Event("", finish_reason="error", error=message))
        for _, future in jobs:
            future.cancel()
        self.rows, self.n_decode = [], 0
        self.cache.reset()

    @torch.inference_mode()
    def step(self) -> None:
        """One scheduling step (see the module docstring)."""
        with autocast(self.device):  # bfloat16 on CUDA; nothing on the CPU
            self._run_jobs()
            for request in [r for r in self.rows if r.cancelled]:
                self._remove(request)
            self._admit()
            if self.blocks is not None:
                self._make_room()
            streams, start = bool(self.rows), self.embeddings.clock()
            if len(self.rows) > self.n_decode and self._mixes():
                self._prefill(self.rows[: self.n_decode])
            else:
                if len(self.rows) > self.n_decode:
                    self._prefill()
                if self.n_decode:
                    self._decode()
            if self.embeddings:
                self.embeddings.run(self.embeddings.clock() - start if streams else None)
        self.metrics.steps.inc()

    def _run_jobs(self) -> None:
        while self.jobs:
            with self._cv:
                fn, future = self.jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)

    def _admit(self) -> None:
        if self.blocks is not None:
            return self._admit_by_blocks(self.blocks)
        while len(self.rows) < self.max_batch:
            with self._cv:
                if not self.waiting:
                    return
                request = self.waiting.popleft()
            if request.cancelled:
                continue
            request.text = IncrementalText(self.lm.decode, request.params.stop)
            request.generator = torch.Generator(device=self.device).manual_seed(request.seed)
            self.cache.clear_row(len(self.rows))
            self.rows.append(request)
            request.admitted_at = time.monotonic()
            self.metrics.prompt_tokens.inc(len(request.prompt))

    def _sample_and_emit(self, logits: Tensor, requests: list[Request]) -> None:
        """Choose each row's next token from ``logits`` (m, v) (``aiayn.serve.sampler.choose``: the
        step's one read from the device) and emit it; finished rows leave (their sampler state
        dropped at once)."""
        for request, (token, info) in zip(requests, choose(logits, requests, self.lm.decode), strict=True):
            self._emit(request, token, info)
        for request in [r for r in requests if r.finished]:
            request.release()
            self._remove(request)

    def _emit(self, request: Request, token: int, info: TokenLogprob | None) -> None:
        now = time.monotonic()
        if request.first_token_at is None:
            request.first_token_at = now
            self.metrics.time_to_first_token.observe(now - request.arrived)
        else:
            self.metrics.inter_token_latency.observe(now - request.last_token_at)
        request.last_token_at, request.last_token = now, token
        request.generated += 1
        self.metrics.token_generated()
        assert request.text is not None
        finish, error = None, None
        grammar_done = False  # the structured answer is complete: nothing but end-of-text may follow
        if request.constraint is not None:
            try:
                request.constraint.advance(token)
                grammar_done = request.constraint.is_finished()
            except ConstraintError as exc:  # a bug (the logits were masked): this request alone fails
                finish, error = "error", f"internal error: {exc}"
        if error is not None:
            text = ""
        elif token == self.lm.eos_id:  # (a grammar allows it only once the answer is complete)
            text, finish = request.text.finish(), "stop"
        else:
            text, stopped = request.text.add(token)
            if stopped:
                finish = "stop"
            elif grammar_done:
                text, finish = text + request.text.finish(), "stop"
            elif request.generated >= request.params.max_tokens:
                text, finish = text + request.text.finish(), "length"
        if finish is not None:
            request.finished = True
            self.metrics.finished(now - request.arrived)
        if not request.cancelled:
            request.sink(Event(text, info, finish, error, token=token))

    def _swap(self, i: int, j: int) -> None:
        if i != j:
            self.cache.swap_rows(i, j)
            self.rows[i], self.rows[j] = self.rows[j], self.rows[i]

    def _remove(self, request: Request) -> None:
        """``request`` is done: free its row."""
        self._free_row(request)
        if self.blocks is not None:
            self.blocks.forget(request)
        request.finished = True

    def _free_row(self, request: Request) -> None:
        """Free ``request``'s row: it moves to the end of the used rows (decoding rows stay first,
        prefilling ones keep their order) and is cleared (a paged row's blocks go back at once)."""
        row = self.rows.index(request)
        if row < self.n_decode:
            self._swap(row, self.n_decode - 1)
            row = self.n_decode = self.n_decode - 1
        for k in range(row, len(self.rows) - 1):
            self._swap(k, k + 1)
        # Cleared before it leaves ``rows``: another thread that sees ``running`` drop sees the row empty.
        self.cache.clear_row(len(self.rows) - 1)
        self.rows.pop()
