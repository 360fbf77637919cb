"""The engine behind ``aiayn serve``: continuous batching of decoder-only generation.

One thread owns the model and a KV cache of ``max_batch`` rows (fixed slots or a paged pool). Each
step: ``Scheduler.schedule`` plans the rows and the forward, ``Runner`` applies the cache operations
and runs it, ``choose`` picks each row's token (the step's one read from the device), ``Output.emit``
sends each request an ``Event`` through its ``sink`` and ``Scheduler.update`` moves the rows on.
Queued embeddings then take at most ``embed_share`` of the engine's time while streams run."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from aiayn.cpu_share import share_cores
from aiayn.device import autocast
from aiayn.serve.blocks import PAGED_COMPILE, BlockPlan, BlockScheduler, SlotPlan, slot_plan
from aiayn.serve.embedding import DEFAULT_CHUNK, EmbeddingJob, EmbeddingQueue
from aiayn.serve.metrics import Metrics
from aiayn.serve.output import Output
from aiayn.serve.request import Event, Request, SamplingParams
from aiayn.serve.runner import Runner
from aiayn.serve.sampler import choose
from aiayn.serve.scheduler import CacheOp, Scheduler, StepPlan
from aiayn.textgen import TextModel

__all__ = ["PAGED_COMPILE", "BlockPlan", "Engine", "EngineFailed", "Event", "QueueFull", "Request", "SamplingParams",
           "ShuttingDown", "SlotPlan", "slot_plan"]

logger = logging.getLogger("aiayn.serve")


class QueueFull(Exception):
    """The waiting queue is at its limit; ``retry_after`` seconds is a fair wait."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The engine takes no new requests."""


class EngineFailed(RuntimeError):
    """A step failed (a bug): the work that was running is told so."""


class Engine:
    """Continuous batching over ``lm``. ``start()`` runs it on a thread; ``submit`` queues a request
    (``QueueFull`` past ``max_queue`` waiting)."""

    def __init__(self, lm: TextModel, plan: SlotPlan | BlockPlan, *, kv_cache: str | None = None, prefill_chunk: int = 512,
                 max_queue: int = 64, metrics: Metrics | None = None, threads: int | None = None,
                 embed_chunk: int = DEFAULT_CHUNK, embed_share: float = 0.5,
                 clock: Callable[[], float] = time.perf_counter, compile: bool = False) -> None:
        if prefill_chunk < 1 or max_queue < 0 or embed_chunk < 1 or not 0 < embed_share < 1:
            raise ValueError("prefill_chunk and embed_chunk must be >= 1, max_queue >= 0, 0 < embed_share < 1")
        if compile and isinstance(plan, BlockPlan):
            raise ValueError(PAGED_COMPILE)
        self.lm, self.plan = lm, plan
        self._cv = threading.Condition()
        self.context, self.max_batch = plan.context, plan.rows
        self.runner = Runner(lm.model, plan, kv_cache=kv_cache, compile=compile)
        self.model, self.device, self.cache, self.compiled = lm.model, self.runner.device, self.runner.cache, self.runner.compiled
        self.blocks = BlockScheduler(self.cache.tables, plan) if isinstance(plan, BlockPlan) else None  # type: ignore[union-attr]
        self.scheduler = Scheduler(plan.rows, prefill_chunk, self._cv, self.blocks, compiled=compile)
        self.rows, self.waiting = self.scheduler.rows, self.scheduler.waiting  # (the scheduler's, read here)
        self.max_queue = max_queue
        self.threads = threads  # torch threads of the engine thread (None: as it finds them)
        self.metrics = metrics or Metrics()
        self.output = Output(lm.decode, lm.eos_id, self.metrics)
        self.embed_chunk = embed_chunk
        self.embeddings = EmbeddingQueue(embed_share, clock, self._cv, self.metrics.embedding_tokens.inc)
        self.running = 0  # requests holding a row, counted once the cache has followed the scheduler
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.metrics.watch_load(self.max_batch, lambda: len(self.waiting), lambda: self.running)
        if (blocks := self.blocks) is not None:
            pool = blocks.tables.pool
            self.metrics.watch_blocks(lambda: pool.used, lambda: pool.available, lambda: blocks.hit_rate)

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
        """Queue the vectors of ``prompts`` (``job.future`` gets them); ``QueueFull`` past
        ``max_batch + max_queue`` jobs."""
        job = EmbeddingJob(self.lm, prompts, self.embed_chunk)
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self.embeddings) >= self.max_batch + self.max_queue:
                raise QueueFull(self.retry_after())
            self.embeddings.jobs.append(job)
            self._cv.notify()
        return job

    def cancel(self, request: Request) -> None:
        """Stop ``request``: out of the queue now, or its row freed at the next step (no more events)."""
        request.cancelled = True
        with self._cv:
            if request in self.waiting:
                self.waiting.remove(request)
            self._cv.notify()

    def retry_after(self) -> int:
        """Seconds until a queued request would likely start (1 to 60)."""
        mean = self.metrics.mean_request_seconds() or 1.0
        return max(1, min(60, round(mean * (len(self.waiting) + 1) / self.max_batch)))

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
                while not (self._stopping or self.waiting or self.rows or self.embeddings):
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                share_cores()  # a fair share of the cores beside other aiayn jobs
                self.step()
            except Exception as exc:  # a bug: fail what is running, keep serving
                logger.exception("engine step failed")
                self._fail_all(f"internal error: {type(exc).__name__}: {exc}")

    def _fail_all(self, message: str) -> None:
        pending = self.scheduler.reset()
        self.embeddings.fail_all(ShuttingDown(message) if self._stopping else EngineFailed(message))
        for request in pending:
            if not request.finished:
                request.finished = True
                request.sink(Event("", finish_reason="error", error=message))
        self.cache.reset()
        self.running = 0

    @torch.inference_mode()
    def step(self) -> None:
        """One step: schedule -> run -> sample -> output, then embeddings."""
        with autocast(self.device):
            plan = self.scheduler.schedule()
            self._apply(plan.ops)
            self._admitted(plan)
            streams, start = bool(self.rows), self.embeddings.clock()
            if plan.runs:
                self._forward(plan)
            if plan.decode_next and self.scheduler.n_decode:
                self._forward(self.scheduler.decode_plan())
            if self.embeddings:
                self.embeddings.run(self.embeddings.clock() - start if streams else None)
        self.metrics.steps.inc()

    def _forward(self, plan: StepPlan) -> None:
        """One forward of ``plan``: run, sample, output; then the rows follow (joins, leaves)."""
        logits = self.runner.forward(plan)
        requests = plan.sampled
        finished = self.output.emit(requests, choose(logits, requests)) if requests else []
        self._apply(self.scheduler.update(plan, finished))
        if plan.decode:
            self.metrics.batch_size.observe(len(plan.decode))

    def _apply(self, ops: list[CacheOp]) -> None:
        self.runner.apply(ops)
        self.running = len(self.rows)

    def _admitted(self, plan: StepPlan) -> None:
        """The newly admitted requests' text and draws (on the model's device)."""
        for request in plan.admitted:
            self.output.start(request)
            request.generator = torch.Generator(device=self.device).manual_seed(request.seed)
            self.metrics.prompt_tokens.inc(len(request.prompt))
        if plan.preempted:
            self.metrics.preemptions.inc(len(plan.preempted))
