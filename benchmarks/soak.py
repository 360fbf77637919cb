"""A soak of ``aiayn serve``: a real server in a subprocess, for a bounded time, under a mix of
hostile and ordinary clients (asyncio tasks on one ``httpx.AsyncClient``), then a report against
the goals. Each client draws its next request: **stream**, **hang-up** (closed after a few chunks),
**embeddings**, **bad** (each must be a 4xx with a JSON error) and **burst** (more than
``--max-batch`` + ``--max-queue``: the overflow must be 429 with ``Retry-After``).

Goals: every well-formed request the server saw answered or 429'd, no 5xx, RSS growth < 10% after
the warm-up, nothing left running or waiting, no traceback in the log, no request lost before the
server. Transport errors are attributed by ``benchmarks.tracked_http``; ``--keepalive-probe`` shows
the keep-alive race alone.

    python -m benchmarks.soak                          # 10 minutes, the shipped shakespeare-char model
    python -m benchmarks.soak --keepalive-probe --keepalive-expiry 5 --seconds 30 --clients 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from aiayn.serve.server import KEEP_ALIVE_SECONDS
from benchmarks.common import footer, free_port, header, percentile, serving, table
from benchmarks.tracked_http import (
    CURRENT,
    Attempt,
    ConnectionBook,
    attribute,
    client_keepalive_expiry,
    server_counts,
    tracked_client,
)

KINDS = ("stream", "hang-up", "embeddings", "bad", "burst")
WEIGHTS = (5, 2, 2, 2, 1)
COMPLETIONS, EMBEDDINGS = "/v1/completions", "/v1/embeddings"
WORDS = ("the king", "a rose", "my lord", "good night", "what news", "to be", "fair Verona", "O Romeo")


@dataclass
class Tally:
    """What the clients saw."""

    status: Counter[tuple[str, int]] = field(default_factory=Counter)  # (kind, HTTP status) -> count
    failures: list[str] = field(default_factory=list)  # goal breaches, one line each (the first 20 kept)
    ttft: list[float] = field(default_factory=list)  # seconds to the first streamed token
    itl: list[float] = field(default_factory=list)  # seconds between streamed chunks
    chunks: int = 0  # streamed completion chunks with text (one per token here) read by clients
    answered: Counter[str] = field(default_factory=Counter)  # route -> responses whose status the clients read
    errors: list[Attempt] = field(default_factory=list)  # transport errors (no status, or the body cut short)
    connections: ConnectionBook = field(default_factory=ConnectionBook)  # the clients' TCP connections

    @property
    def lost_before_server(self) -> list[Attempt]:
        return [e for e in self.errors if e.server_saw is False]

    @property
    def lost_at_server(self) -> list[Attempt]:
        """Transport errors the server saw (or that cannot be told apart from one it saw)."""
        return [e for e in self.errors if e.server_saw is not False]

    def read(self, attempt: Attempt, response: httpx.Response) -> None:
        attempt.status = response.status_code
        self.answered[attempt.route] += 1

    def lost(self, attempt: Attempt, exc: httpx.TransportError) -> None:
        """A transport error: counted and reported, told apart once the server's count is read."""
        attempt.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        self.errors.append(attempt)

    def fail(self, what: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(what)
        else:
            self.failures[-1] = f"... and more ({what})"


@dataclass
class Report:
    seconds: float
    tally: Tally
    rss_warm: int  # bytes, at the end of the warm-up
    rss_end: int
    left_running: int
    left_waiting: int
    tracebacks: int
    log: Path
    keep_alive: float  # the server's --keep-alive seconds

    @property
    def rss_growth(self) -> float:
        return self.rss_end / self.rss_warm - 1

    def goals(self) -> dict[str, bool]:
        return {"every well-formed request the server saw: 200 or 429 with Retry-After, no 5xx":
                    not self.tally.failures and not self.tally.lost_at_server,
                "RSS growth < 10% after the warm-up": self.rss_growth < 0.10,
                "no slot or queue entry left when the clients stop": self.left_running == self.left_waiting == 0,
                "no traceback in the server's log": self.tracebacks == 0,
                "no request lost before it reached the server": not self.tally.lost_before_server}


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def serve_args(args: argparse.Namespace) -> list[str]:
    """The soak's ``aiayn serve`` options (the port aside)."""
    source = ["--model", str(args.model)] if args.model else ["--run", str(args.run)]
    return [*source, "--name", "soak", "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
            "--threads", str(args.threads), "--device", "cpu", "--keep-alive", str(args.server_keep_alive)]


class Clients:
    """The soak's clients against one server (``url``), until ``deadline`` (monotonic seconds)."""

    def __init__(self, client: httpx.AsyncClient, url: str, args: argparse.Namespace, deadline: float,
                 tally: Tally) -> None:
        self.client, self.url, self.args, self.deadline, self.tally = client, url, args, deadline, tally
        self.sent = 0

    def begin(self, kind: str, route: str) -> Attempt:
        """A new request's record, the current one of this asyncio task (the pool fills in its connection)."""
        self.sent += 1
        attempt = Attempt(f"{kind}-{self.sent}", kind, route)
        CURRENT.set(attempt)
        return attempt

    def check(self, kind: str, response, *, well_formed: bool) -> None:
        """Count the answer; a breach of the goals becomes a failure line."""
        code = response.status_code
        self.tally.status[(kind, code)] += 1
        if code >= 500:
            self.tally.fail(f"{kind}: {code} {response.text[:120]!r}")
        elif well_formed and code == 429 and "retry-after" not in response.headers:
            self.tally.fail(f"{kind}: 429 without Retry-After")
        elif well_formed and code not in (200, 429):
            self.tally.fail(f"{kind}: a well-formed request got {code} {response.text[:120]!r}")
        elif not well_formed and not 400 <= code < 500:
            self.tally.fail(f"{kind}: a bad request got {code}")

    async def stream(self, rng: random.Random, *, hang_up: bool, kind: str) -> None:
        attempt = self.begin(kind, COMPLETIONS)
        try:
            await self._stream(attempt, rng, hang_up=hang_up)
        except httpx.TransportError as exc:
            self.tally.lost(attempt, exc)

    async def _stream(self, attempt: Attempt, rng: random.Random, *, hang_up: bool) -> None:
        kind = attempt.kind
        body = {"model": "soak", "prompt": rng.choice(WORDS), "max_tokens": rng.randint(4, 40), "stream": True,
                "temperature": 0}
        start = time.monotonic()
        async with self.client.stream("POST", f"{self.url}{COMPLETIONS}", json=body, headers=attempt.headers) as response:
            self.tally.read(attempt, response)
            if response.status_code != 200:
                await response.aread()
                self.check(kind, response, well_formed=True)
                return
            self.tally.status[(kind, 200)] += 1
            last, chunks, limit = None, 0, rng.randint(1, 3) if hang_up else None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    self.tally.fail(f"{kind}: an error inside the stream {line[:120]!r}")
                    return
                now = time.monotonic()
                if data["choices"] and data["choices"][0].get("text"):
                    chunks += 1
                    self.tally.chunks += 1
                    (self.tally.ttft if last is None else self.tally.itl).append(now - (start if last is None else last))
                    last = now
                if limit is not None and chunks >= limit:
                    return  # hang up: closing the response closes the connection mid-stream

    async def post(self, kind: str, route: str, headers: dict[str, str] | None = None, **body) -> None:
        """POST ``body`` (httpx's ``json=`` or ``content=``) to ``route``; its answer checked."""
        attempt = self.begin(kind, route)
        try:
            response = await self.client.post(f"{self.url}{route}", headers={**(headers or {}), **attempt.headers},
                                              **body)
        except httpx.TransportError as exc:
            self.tally.lost(attempt, exc)
            return
        self.tally.read(attempt, response)
        self.check(kind, response, well_formed=kind != "bad")
        if kind == "bad" and "error" not in response.text:
            self.tally.fail(f"bad: an error without an error body: {response.text[:80]!r}")

    async def embeddings(self, rng: random.Random) -> None:
        inputs = [" ".join(rng.sample(WORDS, 2)) for _ in range(rng.randint(1, 32))]
        await self.post("embeddings", EMBEDDINGS, json={"model": "soak", "input": inputs})

    async def bad(self, rng: random.Random) -> None:
        choice = rng.randrange(5)
        if choice == 0:
            await self.post("bad", COMPLETIONS, {"content-type": "application/json"},
                            content=b'{"model": "soak", "prompt": ')
            return
        body = [{"model": "no-such-model" * 20, "prompt": "hi"}, {"model": "soak", "prompt": "hi", "max_tokens": -3},
                {"model": "soak", "prompt": "hi", "max_tokens": "many"},
                {"model": "soak", "prompt": [10**9, 5], "max_tokens": 2}][choice - 1]
        await self.post("bad", COMPLETIONS, json=body)

    async def burst(self, rng: random.Random) -> None:
        n = self.args.max_batch + self.args.max_queue + 4
        await asyncio.gather(*(self.stream(random.Random(rng.random()), hang_up=False, kind="burst") for _ in range(n)))

    async def run(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            try:
                if kind in ("stream", "hang-up"):
                    await self.stream(rng, hang_up=kind == "hang-up", kind=kind)
                elif kind == "embeddings":
                    await self.embeddings(rng)
                elif kind == "bad":
                    await self.bad(rng)
                else:
                    await self.burst(rng)
            except Exception as exc:  # anything else (a stream that is not JSON, ...) is a failure
                self.tally.fail(f"{kind}: {type(exc).__name__}: {exc}")


async def drive(url: str, args: argparse.Namespace, pid: int) -> tuple[Tally, int, int, int, int]:
    """Run the clients; -> (tally, RSS after the warm-up, RSS at the end, running, waiting left)."""
    tally = Tally()
    start = time.monotonic()
    warm_up = max(5.0, args.seconds / 10)
    async with tracked_client(tally.connections, max_connections=args.clients * (args.max_batch + args.max_queue + 8),
                              keepalive_expiry=args.keepalive_expiry or client_keepalive_expiry(args.server_keep_alive)) as client:
        before = await server_counts(client, url)
        clients = Clients(client, url, args, start + args.seconds, tally)
        tasks = [asyncio.create_task(clients.run(args.seed * 1000 + i)) for i in range(args.clients)]
        await asyncio.sleep(warm_up)
        rss_warm = rss_bytes(pid)
        await asyncio.gather(*tasks)
        # Every client has stopped: what the server still holds is leaked (after a moment for hang-ups).
        running = waiting = -1
        for _ in range(40):
            health = (await client.get(f"{url}/health")).json()
            running, waiting = health["running"], health["waiting"]
            if running == waiting == 0:
                break
            await asyncio.sleep(0.25)
        await settle(client, url, before, tally)
        return tally, rss_warm, rss_bytes(pid), running, waiting


async def settle(client: httpx.AsyncClient, url: str, before: Counter[str], tally: Tally) -> None:
    """Tell each transport error apart by the server's count of requests since ``before`` (the
    server counts a request as it ends: a hang-up's may still be ending, so a few reads)."""
    for _ in range(20):
        problems = attribute(tally.errors, tally.answered, await server_counts(client, url) - before)
        if not problems:
            return
        await asyncio.sleep(0.25)
    for line in problems:
        tally.fail(f"the counts do not add up: {line}")


async def probe(url: str, args: argparse.Namespace) -> Tally:
    """``--clients`` clients, each with a one-connection pool, GET /health after idle gaps drawn
    around the server's keep-alive timeout (and the client's expiry), for ``--seconds``."""
    tally = Tally()
    server = args.server_keep_alive
    expiry = args.keepalive_expiry or client_keepalive_expiry(server)
    windows = sorted({server, min(expiry, server)})
    sent = Counter[str]()
    # The pools are made before the clock starts (making 60 can take seconds on a busy machine).
    pools = [tracked_client(tally.connections, max_connections=1, keepalive_expiry=expiry, timeout=30.0)
             for _ in range(args.clients)]
    deadline = time.monotonic() + args.seconds

    async def one(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        async with pools[index] as client:
            await asyncio.sleep(rng.uniform(0, server))  # spread the clients out
            while time.monotonic() < deadline:
                sent["n"] += 1
                attempt = Attempt(f"probe-{index}-{sent['n']}", "probe", "/health")
                CURRENT.set(attempt)
                try:
                    response = await client.get(f"{url}/health", headers=attempt.headers)
                    tally.read(attempt, response)
                    tally.status[("probe", response.status_code)] += 1
                except httpx.TransportError as exc:
                    tally.lost(attempt, exc)
                end = rng.choice(windows)  # idle until just before or around it (the race is there)
                await asyncio.sleep(rng.uniform(end - 0.15, end + 0.05))

    async with httpx.AsyncClient() as client:
        before = await server_counts(client, url)
        await asyncio.gather(*(one(i) for i in range(args.clients)))
        await settle(client, url, before, tally)
    return tally


def run_soak(args: argparse.Namespace) -> Report:
    log = Path(args.log) if args.log else Path(tempfile.mkdtemp(prefix="aiayn-soak-")) / "server.log"
    port = free_port()
    with serving(serve_args(args), port=port, log=log, timeout=180) as proc:
        start = time.monotonic()
        tally, rss_warm, rss_end, running, waiting = asyncio.run(drive(f"http://127.0.0.1:{port}", args, proc.pid))
    tracebacks = log.read_text(errors="replace").count("Traceback")
    return Report(time.monotonic() - start, tally, rss_warm, rss_end, running, waiting, tracebacks, log,
                  args.server_keep_alive)


def run_probe(args: argparse.Namespace) -> Tally:
    """``--keepalive-probe``: the keep-alive race alone, against a fresh server."""
    with serving(serve_args(args), port=(port := free_port()), log=Path(args.log) if args.log else None, timeout=180):
        return asyncio.run(probe(f"http://127.0.0.1:{port}", args))


def transport_lines(tally: Tally, keep_alive: float) -> list[str]:
    errors = tally.errors
    lines = [f"{tally.connections.summary()}; the server closes a connection idle {keep_alive:g} s",
             f"transport errors (no status, or a body cut short): {len(errors)}: the server saw "
             f"{len(tally.lost_at_server)}, {len(tally.lost_before_server)} never reached it"]
    lines += [f"  - {e.describe()}" for e in errors[:20]]
    if len(errors) > 20:
        lines.append(f"  - ... and {len(errors) - 20} more")
    return lines


def print_report(report: Report) -> None:
    tally = report.tally
    print(f"\n## soak: {report.seconds:.0f} s, {sum(tally.status.values())} requests, "
          f"{tally.chunks} streamed chunks; server log {report.log}\n")
    print(table(["request", "status", "count"], [[*key, count] for key, count in sorted(tally.status.items())]))
    print(f"\nTTFT p50 / p99: {percentile(tally.ttft, 50) * 1e3:.0f} / {percentile(tally.ttft, 99) * 1e3:.0f} ms; "
          f"inter-token p50 / p99: {percentile(tally.itl, 50) * 1e3:.0f} / {percentile(tally.itl, 99) * 1e3:.0f} ms")
    print(f"RSS {report.rss_warm / 2**20:.0f} MiB after the warm-up, {report.rss_end / 2**20:.0f} MiB at the end "
          f"({report.rss_growth:+.1%}); left running {report.left_running}, waiting {report.left_waiting}; "
          f"tracebacks in the log: {report.tracebacks}")
    print("\n".join(transport_lines(tally, report.keep_alive)) + "\n")
    for goal, met in report.goals().items():
        print(f"* {goal}: {'met' if met else 'MISSED'}")
    for line in tally.failures:
        print(f"  - {line}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long the clients run (default 600)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--model", type=Path, help="a GGUF file or Hugging Face directory to serve")
    parser.add_argument("--run", type=Path, help="a run or release directory to serve (default: the shipped "
                                                 "shakespeare-char)")
    parser.add_argument("--max-batch", type=int, default=4, help="the server's --max-batch (default 4)")
    parser.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="the server's --threads (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the clients' random choices (default 0)")
    parser.add_argument("--log", help="where the server's output goes (default: a temporary file)")
    parser.add_argument("--keepalive-probe", action="store_true",
                        help="instead of the soak: --clients clients each reuse one pooled connection after idle "
                             "gaps near the server's keep-alive timeout, for --seconds; reports transport errors")
    parser.add_argument("--server-keep-alive", type=float, default=KEEP_ALIVE_SECONDS,
                        help=f"the server's --keep-alive seconds (default {KEEP_ALIVE_SECONDS:g}, aiayn serve's; "
                             "uvicorn's own default is 5)")
    parser.add_argument("--keepalive-expiry", type=float,
                        help="seconds the clients keep an idle pooled connection (default: half the server's "
                             "keep-alive timeout; httpx's default is 5)")
    args = parser.parse_args(argv)
    if not args.server_keep_alive > 0:
        parser.error(f"--server-keep-alive must be a positive number of seconds, got {args.server_keep_alive}")
    if args.keepalive_expiry is not None and not args.keepalive_expiry > 0:
        parser.error(f"--keepalive-expiry must be a positive number of seconds, got {args.keepalive_expiry}")
    if args.model is None and args.run is None:
        from aiayn.tasks.trained import shipped_path

        args.run = shipped_path("shakespeare-char")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    what = "the keep-alive probe" if args.keepalive_probe else "a soak"
    header(f"`aiayn serve` under {what}: {args.clients} clients for {args.seconds:.0f} s; threads: the server's", args)
    if args.keepalive_probe:
        tally = run_probe(args)
        print(f"\n## keep-alive probe: {args.clients} clients for {args.seconds:.0f} s, pooled connections kept "
              f"{args.keepalive_expiry or client_keepalive_expiry(args.server_keep_alive)} s; "
              f"{tally.answered['/health']} answers\n")
        print("\n".join(transport_lines(tally, args.server_keep_alive)))
        passed = not tally.errors and not tally.failures
    else:
        report = run_soak(args)
        print_report(report)
        passed = all(report.goals().values())
    footer()
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
