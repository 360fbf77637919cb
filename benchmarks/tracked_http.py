"""An httpx client that knows which pooled connection carried each request and how long it had
been idle, and whether the server saw a request that failed in transport (from its /metrics); used
by benchmarks/soak.py. uvicorn closes a connection idle for its keep-alive timeout, so a request
sent on one idle just under that can reach the socket as the server closes it, unread: a client
must give up pooled connections well before (``client_keepalive_expiry``).
"""

from __future__ import annotations

import functools
import ssl
import time
from collections import Counter
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx
from prometheus_client.parser import text_string_to_metric_families


def client_keepalive_expiry(server_keep_alive: float) -> float:
    """Seconds a pooled connection may idle before the client gives it up: half the server's
    keep-alive timeout. The two clocks start at different moments and a request waits on both event
    loops (up to a second on a loaded machine), so equal timeouts leave a window where the server
    closes the socket under a request it never reads."""
    return server_keep_alive / 2


@dataclass
class Attempt:
    """One request as the connection layer saw it."""

    id: str  # sent as X-Request-Id
    kind: str
    route: str  # the server's route label (/metrics)
    connection: int | None = None  # the client's port of the TCP connection it went out on (None: none)
    idle: float | None = None  # seconds that connection had received nothing (None: a new connection)
    status: int | None = None  # the HTTP status, once the response's head arrived
    error: str = ""  # a transport error ("ReadError: ..."), "" if none
    server_saw: bool | None = None  # for an error: the server counted it; None: cannot tell which

    @property
    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.id}

    def describe(self) -> str:
        where = ("before any connection" if self.connection is None else
                 f"on a new connection (port {self.connection})" if self.idle is None else
                 f"on a connection reused after {self.idle:.3f} s idle (port {self.connection})")
        saw = {True: "the server saw it", False: "it never reached the server", None: "the server saw some of these"}
        return f"{self.kind} {self.id}: {self.error} {where}; {saw[self.server_saw]}"


# The request the current asyncio task is sending (httpcore runs in the caller's task and fills it in).
CURRENT: ContextVar[Attempt | None] = ContextVar("CURRENT", default=None)


class TrackedStream(httpcore.AsyncNetworkStream):
    """A TCP stream that notes when it last received bytes and which request writes on it."""

    def __init__(self, stream: httpcore.AsyncNetworkStream, book: ConnectionBook) -> None:
        self.stream, self.book = stream, book
        self.port: int = stream.get_extra_info("client_addr")[1]
        self.last_heard: float | None = None  # monotonic seconds; None until the first response
        self.attempt: Attempt | None = None

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = await self.stream.read(max_bytes, timeout)
        self.last_heard = time.monotonic()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        attempt = CURRENT.get()
        if attempt is not None and attempt is not self.attempt:  # a request's first bytes (its head)
            self.attempt, attempt.connection = attempt, self.port
            attempt.idle = None if self.last_heard is None else time.monotonic() - self.last_heard
            self.book.sent(attempt)
        await self.stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self.stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class ConnectionBook(httpcore.AsyncNetworkBackend):
    """httpcore's asyncio backend, its streams tracked; counts connections and reuses."""

    def __init__(self) -> None:
        self.backend = httpcore.AnyIOBackend()
        self.opened = 0
        self.reused = 0
        self.longest_reuse = 0.0  # seconds: the longest idle of a connection a request reused

    def sent(self, attempt: Attempt) -> None:
        if attempt.idle is not None:
            self.reused += 1
            self.longest_reuse = max(self.longest_reuse, attempt.idle)

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        stream = await self.backend.connect_tcp(host, port, timeout, local_address, socket_options)
        self.opened += 1
        return TrackedStream(stream, self)

    async def sleep(self, seconds: float) -> None:
        await self.backend.sleep(seconds)

    def summary(self) -> str:
        return (f"{self.opened} connections opened, {self.reused} requests on a reused one (idle at most "
                f"{self.longest_reuse:.2f} s)")


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def tracked_client(book: ConnectionBook, *, max_connections: int, keepalive_expiry: float,
                   timeout: float = 120.0) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose pool connects through ``book``; the clients share one SSL
    context (httpx makes one per transport otherwise, tens of ms of CPU each)."""
    transport = httpx.AsyncHTTPTransport(verify=shared_ssl_context())
    # httpx has no public way to give its pool a network backend; httpcore's pool takes one.
    transport._pool = httpcore.AsyncConnectionPool(max_connections=max_connections,
                                                   max_keepalive_connections=max_connections,
                                                   keepalive_expiry=keepalive_expiry, network_backend=book)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout))


async def server_counts(client: httpx.AsyncClient, url: str) -> Counter[str]:
    """Requests the server has answered (or ended) so far, by route, from its /metrics."""
    counts: Counter[str] = Counter()
    text = (await client.get(f"{url}/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "aiayn_requests":
            for sample in family.samples:
                if sample.name == "aiayn_requests_total":
                    counts[sample.labels["route"]] += int(sample.value)
    return counts


def attribute(errors: list[Attempt], answered: Counter[str], counted: Counter[str]) -> list[str]:
    """Set ``server_saw`` of each transport error: one whose response head arrived was seen; the
    others by route, from what the server counted (``counted``, since the clients began) beyond the
    answers the clients read (``answered``). -> lines for counts that do not add up."""
    problems = []
    for route in sorted(set(answered) | {e.route for e in errors}):  # the routes the clients asked
        headless = [e for e in errors if e.route == route and e.status is None]
        for e in errors:
            if e.route == route and e.status is not None:
                e.server_saw = True
        seen = counted[route] - answered[route]  # requests the server ended without the client reading a status
        if not 0 <= seen <= len(headless):
            problems.append(f"{route}: the server counted {counted[route]} requests, the clients read "
                            f"{answered[route]} answers and lost {len(headless)} before an answer")
        for e in headless:
            e.server_saw = {0: False, len(headless): True}.get(seen)
    return problems
