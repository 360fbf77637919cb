"""Sentence vectors from a decoder-only model, read one forward at a time (``EmbeddingJob``).

A vector is the mean of the last hidden states over an input's tokens, L2-normalised. An input
longer than ``chunk`` tokens is read in pieces over a KV cache of its own, so a job run at once
gives the same bits as one the engine slices between its decode steps (``EmbeddingQueue``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.device import autocast, model_device, synchronize
from aiayn.nn.kv_cache import KVCache
from aiayn.textgen import TextModel

logger = logging.getLogger("aiayn.serve")

DEFAULT_CHUNK = 64  # tokens per forward: SmolLM2 on 2 idle cores, about two decode steps' time


class EmbeddingJob:
    """One embeddings request's inputs (token ids), read by ``forward`` calls; ``future`` gets the
    (n, d) float32 CPU vectors once the last is read."""

    def __init__(self, lm: TextModel, prompts: list[list[int]], chunk: int = DEFAULT_CHUNK) -> None:
        self.lm, self.chunk = lm, chunk
        self.device = model_device(lm.model)
        self.inputs = [torch.tensor(ids, dtype=torch.long) for ids in prompts]
        self.tokens = sum(len(ids) for ids in prompts)
        self.future: concurrent.futures.Future[Tensor] = concurrent.futures.Future()
        self.means: list[Tensor] = []  # (d,) float32 on the CPU, one per input read
        self.index = 0  # the input being read
        self.fed = 0  # its tokens read so far (a long input)
        self.cache: KVCache | None = None  # a long input's keys and values, while it is read
        self.total: Tensor | None = None  # (d,) the sum of its hidden states so far
        self.forwards = 0
        self.cancelled = False  # set from any thread: the engine drops the job at its next forward

    @property
    def done(self) -> bool:
        return self.index == len(self.inputs)

    @property
    def next_tokens(self) -> int:
        return min(self.chunk, len(self.inputs[self.index]) - self.fed)

    def forward(self) -> int:
        """Read the next piece (an input of up to ``chunk`` tokens, or the next ``chunk`` of a longer
        one) under the caller's inference mode and autocast; returns its tokens."""
        ids = self.inputs[self.index]
        n = len(ids)
        self.forwards += 1
        if n <= self.chunk:  # one forward, no cache
            hidden = self.lm.model(ids[None].to(self.device)).hidden  # (1, t, d)
            mean = hidden[0].float().mean(dim=0)  # (d,)
        else:
            if self.cache is None:
                self.cache = self.lm.model.new_cache(1, n)
                self.total = torch.zeros(self.lm.model.config.d_model, device=self.device)
            piece = ids[self.fed: self.fed + self.chunk]
            hidden = self.lm.model(piece[None].to(self.device), cache=self.cache).hidden  # (1, c, d)
            assert self.total is not None
            self.total += hidden[0].float().sum(dim=0)
            self.fed += len(piece)
            if self.fed < n:
                synchronize(self.device)  # the engine times each forward: wait for a GPU's work
                return len(piece)
            mean = self.total / n
            self.cache = self.total = None  # the cache is freed with the input
            self.fed = 0
            n = len(piece)
        self.means.append(mean.cpu())  # the input's one read from the device
        self.index += 1
        return n

    def result(self) -> Tensor:
        """(n, d) unit vectors, once ``done``."""
        assert self.done
        return F.normalize(torch.stack(self.means), dim=-1)

    def run(self) -> Tensor:
        """Every forward at once (no engine): what a sliced run gives, bit for bit."""
        with torch.inference_mode(), autocast(self.device):
            while not self.done:
                self.forward()
        return self.result()


class ForwardCost:
    """Seconds a forward of n tokens takes, a + b n, fitted by least squares to the recent forwards
    (each older one ``decay`` times lighter); proportional to n while one size was seen."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, n, t, n^2, n t

    def observe(self, n: int, seconds: float) -> None:
        self.sums = tuple(self.decay * s + x for s, x in zip(self.sums, (1.0, n, seconds, n * n, n * seconds),
                                                             strict=True))

    def __call__(self, n: int) -> float:
        w, sn, st, snn, snt = self.sums
        if w == 0.0:
            return 0.0  # nothing seen yet: the first forward goes at once
        spread = w * snn - sn * sn
        if spread <= 1e-6 * w * snn:
            return st / sn * n
        b = (w * snt - sn * st) / spread
        return max(0.0, (st - b * sn) / w + b * n)


class EmbeddingQueue:
    """The engine's embedding jobs and their share of its time: ``run`` does forwards, the jobs in
    turn, while a credit covers them. Each step adds ``streams * share / (1 - share)`` seconds, a
    forward starts when the credit holds its expected time (``ForwardCost``) and takes its real time
    off. With no stream, one forward a step."""

    def __init__(self, share: float, clock: Callable[[], float], lock: threading.Condition,
                 read: Callable[[int], None] = lambda tokens: None) -> None:
        self.share, self.clock, self.lock = share, clock, lock
        self.read = read  # told the tokens of each forward (the metrics)
        self.jobs: deque[EmbeddingJob] = deque()  # the next forward's job first
        # The job whose forward runs now (out of ``jobs`` meanwhile): it still counts in ``len``.
        self.active: EmbeddingJob | None = None
        self.credit = 0.0  # seconds of forwards the streams' share allows now
        # Seconds of stream and embedding forwards in the steps that had both: the share, measured.
        self.shared_seconds = {"streams": 0.0, "embeddings": 0.0}
        self.forwards = 0  # embedding forwards run, in all
        self.cost = ForwardCost()

    def __len__(self) -> int:
        """Jobs the queue holds: waiting, and the one in its forward."""
        return len(self.jobs) + (self.active is not None)

    def cancel(self, job: EmbeddingJob) -> None:
        """Drop ``job`` (its client is gone): no more forwards for it."""
        job.cancelled = True
        with self.lock, contextlib.suppress(ValueError):  # (not queued: in its forward, or done)
            self.jobs.remove(job)
        job.future.cancel()

    def fail_all(self, error: Exception) -> None:
        with self.lock:
            jobs = list(self.jobs)
            self.jobs.clear()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)
        self.credit = 0.0

    def run(self, streams: float | None) -> None:
        """Forwards after the streams took ``streams`` seconds this step (None: no stream ran)."""
        if streams is None:
            self.credit = 0.0  # no debt or savings carried into the next streams' steps
        else:
            self.credit += streams * self.share / (1 - self.share)
            self.shared_seconds["streams"] += streams
        while self.jobs and (streams is None or self.credit > 0):
            with self.lock:
                job = self.jobs.popleft()
                self.active = job
            try:
                if not self._turn(job, streams):
                    break
            finally:
                with self.lock:
                    self.active = None
        if not self.jobs:
            self.credit = 0.0

    def _turn(self, job: EmbeddingJob, streams: float | None) -> bool:
        """One forward of ``job``, or its turn kept when the credit is short -> whether another may follow."""
        if job.cancelled or job.future.done():
            return True
        tokens = job.next_tokens
        if streams is not None and self.credit < self.cost(tokens) * (1 - 1e-9):  # (the fit's rounding)
            with self.lock:
                self.jobs.appendleft(job)  # its turn stays: the next steps pay for it
            return False
        start = self.clock()
        try:
            self.read(job.forward())
        except Exception as exc:  # this job's failure (its memory, a bug) fails it alone
            logger.exception("an embedding forward failed")
            job.future.set_exception(exc)
            return True
        finally:
            spent = self.clock() - start
            self.forwards += 1
            self.cost.observe(tokens, spent)
        if streams is not None:
            self.credit -= spent
            self.shared_seconds["embeddings"] += spent
        if job.done:
            job.future.set_result(job.result())
        else:
            with self.lock:
                self.jobs.append(job)  # behind the others
        return streams is not None  # with no stream, one forward a step

