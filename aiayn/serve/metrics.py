"""The server's Prometheus metrics (``GET /metrics``), a registry per server (several may share a process)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

RATE_WINDOW = 10.0  # seconds over which the tokens/s gauge counts
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# (kind, name, help) of the metrics ``Metrics`` holds as attributes, in the order /metrics lists them.
METRICS = (
    ("counter", "aiayn_prompt_tokens", "Prompt tokens admitted"),
    ("counter", "aiayn_generation_tokens", "Tokens generated"),
    ("counter", "aiayn_engine_steps", "Engine steps run"),
    ("counter", "aiayn_embedding_tokens", "Embedding input tokens read (decoder models)"),
    ("latency", "aiayn_time_to_first_token_seconds", "From arrival to the first generated token"),
    ("latency", "aiayn_inter_token_latency_seconds", "Between two tokens of one request"),
    ("latency", "aiayn_request_seconds", "From arrival to the last token"),
    ("batch", "aiayn_decode_batch_size", "Rows in a decode step"),
    ("gauge", "aiayn_queue_depth", "Requests waiting for a slot"),
    ("gauge", "aiayn_running_requests", "Requests holding a slot (prefilling or decoding)"),
    ("gauge", "aiayn_batch_occupancy", "Share of the KV-cache slots in use (0 to 1)"),
    ("gauge", "aiayn_kv_cache_slots", "KV-cache slots (the most concurrent requests)"),
    ("counter", "aiayn_preemptions", "Requests preempted for KV-cache blocks (recomputed later)"),
    ("gauge", "aiayn_kv_cache_blocks_used", "Paged KV-cache blocks held by requests"),
    ("gauge", "aiayn_kv_cache_blocks_free", "Paged KV-cache blocks free or holding an unused cached prefix"),
    ("gauge", "aiayn_prefix_cache_hit_rate", "Share of admitted prompt tokens found in the prefix cache"),
)


class Metrics:
    """The counters, gauges and histograms of one server."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        counter, gauge = partial(Counter, registry=registry), partial(Gauge, registry=registry)
        latency = partial(Histogram, buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = counter("aiayn_requests", "HTTP requests answered, by route and status code", ["route", "status"])
        make = {"counter": counter, "gauge": gauge, "latency": latency,
                "batch": partial(Histogram, buckets=BATCH_BUCKETS, registry=registry)}
        (self.prompt_tokens, self.generation_tokens, self.steps, self.embedding_tokens, self.time_to_first_token,
         self.inter_token_latency, self.request_seconds, self.batch_size, self.queue_depth, self.running,
         self.occupancy, self.slots, self.preemptions, self.kv_blocks_used, self.kv_blocks_free,
         self.prefix_hit_rate) = (make[kind](name, text) for kind, name, text in METRICS)
        self.tokens_per_second = gauge("aiayn_generation_tokens_per_second",
                                       f"Tokens generated per second over the last {RATE_WINDOW:g} s")
        self.tokens_per_second.set_function(self._rate)
        self._lock = threading.Lock()
        self._recent: deque[float] = deque()  # when each recent token was generated
        self._durations: deque[float] = deque(maxlen=64)  # seconds of the last finished requests

    def watch_load(self, slots: int, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        """The queue and batch gauges: ``slots`` rows, read ``waiting()`` and ``running()`` at every scrape."""
        self.queue_depth.set_function(waiting)
        self.running.set_function(running)
        self.occupancy.set_function(lambda: running() / slots)
        self.slots.set(slots)

    def watch_blocks(self, used: Callable[[], float], free: Callable[[], float], hit_rate: Callable[[], float]) -> None:
        """The paged cache's gauges (``aiayn.serve.blocks``), read at every scrape."""
        self.kv_blocks_used.set_function(used)
        self.kv_blocks_free.set_function(free)
        self.prefix_hit_rate.set_function(hit_rate)

    def token_generated(self) -> None:
        with self._lock:
            self._recent.append(time.monotonic())
        self.generation_tokens.inc()

    def _rate(self) -> float:
        cutoff = time.monotonic() - RATE_WINDOW
        with self._lock:
            while self._recent and self._recent[0] < cutoff:
                self._recent.popleft()
            return len(self._recent) / RATE_WINDOW

    def finished(self, seconds: float) -> None:
        self.request_seconds.observe(seconds)
        self._durations.append(seconds)

    def mean_request_seconds(self) -> float | None:
        durations = list(self._durations)
        return sum(durations) / len(durations) if durations else None

    def render(self) -> bytes:
        return generate_latest(self.registry)
