"""Serving SmolLM2-135M-Instruct over HTTP: ``aiayn serve`` (continuous batching) under 1, 4 and 16
concurrent clients, against the same requests served one at a time, and against Hugging Face
transformers' batched ``generate`` on the same prompts (static batching), in one run.

The clients are ``openai``'s, each streaming greedy completions of Tiny Shakespeare windows. Per
run: tokens/s, TTFT and inter-token latency p50 / p99, the server's CPU seconds. Every run has
prompts the server has not seen (the paged layout's prefix cache would make a repeat nearly free);
one extra run repeats the largest count's prompts. transformers' TTFT is its time for one token.
Targets at 16 clients: >= 6x one at a time, >= 1.5x transformers, TTFT p99 <= 2 s.

    python -m benchmarks.serve --kv-layout paged slots   # both KV-cache layouts, side by side
    python -m benchmarks.serve --quantize auto     # the server on the GGUF file's 4-bit blocks
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import common

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
           "in want of a wife. However little known the feelings or views of such a man may be on his first "
           "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
           "he is considered the rightful property of some one or other of their daughters. ")


@dataclass
class Run:
    """One set of requests: their timings and tokens."""

    label: str
    wall: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)
    cpu: float = 0.0  # CPU seconds the server (or transformers' process) spent on the run

    @property
    def rate(self) -> float:
        return self.tokens / self.wall

    @property
    def cpu_rate(self) -> float:
        return self.tokens / self.cpu if self.cpu > 0 else float("nan")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def make_prompts(encode, n: int, length: int) -> list[list[int]]:
    """``n`` different prompts of exactly ``length`` token ids: windows of Tiny Shakespeare."""
    corpus = Path(os.environ.get("AIAYN_DATA_DIR", common.ROOT.parent / "shared" / "data")) / "tinyshakespeare" / "input.txt"
    text = corpus.read_text(encoding="utf-8")[:200_000] if corpus.is_file() else PASSAGE * 200
    ids = encode(text)
    step = max(length, (len(ids) - length) // n)
    return [ids[i * step: i * step + length] for i in range(n)]


def prompt_sets(pool: list[list[int]], sequential: int, clients: list[int]
                ) -> tuple[list[list[int]], list[list[int]], dict[int, list[list[int]]]]:
    """``pool`` cut into disjoint sets: an 8-token warm-up, the one-at-a-time run's ``sequential``
    prompts, and ``n`` prompts per client count ``n`` (no run sees a prompt served before)."""
    warm_up, rest = [pool[-1][:8]], pool[:-1]
    sets, start = {}, sequential
    for n in clients:
        sets[n], start = rest[start: start + n], start + n
    return warm_up, rest[:sequential], sets


async def one_request(client, model: str, prompt: list[int], new_tokens: int, run: Run) -> None:
    start = time.perf_counter()
    last = None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            run.tokens += chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            if last is None:
                run.ttft.append(now - start)
            else:
                run.itl.append(now - last)
            last = now


def openai_client(url: str):  # -> openai.AsyncOpenAI
    import openai

    return openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600)


async def serve_clients(url: str, model: str, prompts: list[list[int]], clients: int, new_tokens: int,
                        label: str, pid: int) -> Run:
    """``clients`` clients, each sending its share of ``prompts`` in turn, all at once."""
    run = Run(label)
    client = openai_client(url)
    shares = [prompts[i::clients] for i in range(clients)]

    async def client_loop(share: list[list[int]]) -> None:
        for prompt in share:
            await one_request(client, model, prompt, new_tokens, run)

    load, cpu = os.getloadavg()[0], cpu_seconds(pid)
    start = time.perf_counter()
    await asyncio.gather(*(client_loop(share) for share in shares))
    run.wall = time.perf_counter() - start
    run.load, run.cpu = (load, os.getloadavg()[0]), cpu_seconds(pid) - cpu
    await client.close()
    return run


def serve_args(args: argparse.Namespace, model_path: Path, kv_layout: str = "paged") -> list[str]:
    """The benchmark's ``aiayn serve`` options (the port aside), with the KV cache in ``kv_layout``."""
    options = ["--kv-layout", kv_layout, "--model", str(model_path), "--name", "bench", "--max-batch", str(max(args.clients)), "--context",
               str(args.prompt_tokens + args.new_tokens + 8), "--threads", str(args.threads),
               "--prefill-chunk", str(args.prefill_chunk), "--max-queue", "256"]
    if args.kv_cache != "float":
        options += ["--kv-cache", args.kv_cache]
    if args.quantize != "none":
        options += ["--quantize", args.quantize]
    return options


def hf_static(model_path: Path, prompts: list[list[int]], new_tokens: int, threads: int) -> Run:
    """transformers' batched generate over all ``prompts`` at once (its TTFT: the time of one new token)."""
    import torch

    torch.set_num_threads(threads)
    model = common.hf_causal_lm(model_path)
    ids = torch.tensor(prompts)

    def generate(n: int) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        common.hf_greedy(model, ids, n, min_new_tokens=n)
        return time.perf_counter() - start, time.process_time() - cpu

    generate(2)  # warm-up
    run = Run(f"transformers static batch of {len(prompts)}", ttft=[generate(1)[0]])
    load = os.getloadavg()[0]
    run.wall, run.cpu = generate(new_tokens)
    run.load = (load, os.getloadavg()[0])
    run.tokens = len(prompts) * new_tokens
    return run


def row(run: Run, clients: int | str, requests: int) -> str:
    ttft = f"{common.percentile(run.ttft, 50):.2f} / {common.percentile(run.ttft, 99):.2f}" if run.ttft else "-"
    itl = f"{1000 * common.percentile(run.itl, 50):.0f} / {1000 * common.percentile(run.itl, 99):.0f}" if run.itl else "-"
    return (f"| {run.label} | {clients} | {requests} | {run.tokens:,} | {run.wall:.1f} | {run.rate:.1f} | {ttft} | "
            f"{itl} | {run.cpu:.1f} | {run.cpu_rate:.1f} | {run.load[0]:.1f} -> {run.load[1]:.1f} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sequential", type=int, default=16,
                        help="requests of the one-at-a-time baseline (the first N prompts; default 16)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--kv-cache", choices=["float", "int8"], default="float")
    parser.add_argument("--kv-layout", choices=["paged", "slots"], nargs="+", default=["paged"],
                        help="the server's KV-cache layout(s), each measured in turn (default: paged, the server's "
                             "default; int8 keys and values need slots)")
    parser.add_argument("--quantize", choices=["none", "bf16", "int8", "q4", "auto"], default="none",
                        help="the server's weights, as `aiayn serve --quantize` (auto: a GGUF file's own "
                             "4-bit blocks); the transformers peer stays float32")
    parser.add_argument("--port", type=int, default=8631)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--model", type=Path, help="a GGUF file or Hugging Face directory (default: SmolLM2)")
    args = parser.parse_args(argv)
    args.clients = sorted(set(args.clients))  # one run (and one prompt set) per client count
    return args


def serve_layout(args: argparse.Namespace, model_path: Path, layout: str, prompts: tuple,
                 runs: list[tuple[Run, int | str, int]]) -> tuple[Run, dict[int, Run], Run]:
    """A server with the KV cache in ``layout``: one at a time, each client count, the largest
    count's prompts again; (one at a time, by client count, again)."""
    warm_up, sequential_prompts, prompts_for = prompts
    name = f"aiayn serve ({layout})" if len(args.kv_layout) > 1 else "aiayn serve"
    url, top = f"http://127.0.0.1:{args.port}/v1", max(args.clients)

    def measure(label: str, share: list[list[int]], clients: int) -> Run:
        run = asyncio.run(serve_clients(url, "bench", share, clients, args.new_tokens, f"{name}, {label}", proc.pid))
        runs.append((run, clients, len(share)))
        print(row(*runs[-1]), flush=True)
        return run

    with common.serving(serve_args(args, model_path, layout), port=args.port) as proc:
        asyncio.run(serve_clients(url, "bench", warm_up, 1, 8, "warm-up", proc.pid))
        sequential = measure("one at a time", sequential_prompts, 1)
        by_clients = {n: measure("continuous batching", prompts_for[n], n) for n in args.clients}
        return sequential, by_clients, measure("prompts served before", prompts_for[top], top)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common.require("openai")  # the clients
    from aiayn.textgen import read_text_model

    model_path = common.smollm2(args.model)
    pool = make_prompts(read_text_model(model_path).encode, args.sequential + sum(args.clients) + 1,
                        args.prompt_tokens)
    prompts = prompt_sets(pool, args.sequential, args.clients)
    top = max(args.clients)
    weights = "float32" if args.quantize == "none" else f"--quantize {args.quantize}"
    common.header(f"aiayn serve: {model_path.name} ({weights}), {args.prompt_tokens}-token prompts, {args.new_tokens} new "
           "tokens, greedy", args, dtype=weights)
    runs: list[tuple[Run, int | str, int]] = []
    layouts = {layout: serve_layout(args, model_path, layout, prompts, runs) for layout in args.kv_layout}
    hf = None if args.no_hf else common.load_peer("transformers", hf_static, model_path, prompts[2][top],
                                                  args.new_tokens, args.threads)
    if hf is not None:
        runs.append((hf, "static", top))
    print("\n| server | clients | requests | tokens | seconds | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
          "| CPU s | tokens / CPU s | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        print(row(*run))
    print()
    summary(args, layouts, hf)
    common.footer()


def summary(args: argparse.Namespace, layouts: dict[str, tuple[Run, dict[int, Run], Run]], hf: Run | None) -> None:
    """The ratio lines of every layout against the targets (and paged / slots when both ran)."""
    top = max(args.clients)
    for layout, (sequential, by_clients, repeat) in layouts.items():
        best = by_clients[top]
        which = f" ({layout})" if len(layouts) > 1 else ""
        print(f"* {top} clients / one at a time{which}: **{best.rate / sequential.rate:.2f}x** (target >= 6x)")
        if hf is not None:
            print(f"* {top} clients / transformers static batch of {top}{which}: **{best.rate / hf.rate:.2f}x** "
                  f"(target >= 1.5x)")
        print(f"* TTFT p99 at {top} clients{which}: **{common.percentile(best.ttft, 99):.2f} s** (target <= 2 s); the same "
              f"prompts served again (prefix-cache hits where the layout has a cache): "
              f"{common.percentile(repeat.ttft, 99):.2f} s")
        print(f"* by CPU time{which} (tokens per CPU second; less sensitive to other jobs, but spinning worker "
              f"threads count too): {top} clients / one at a time {best.cpu_rate / sequential.cpu_rate:.2f}x"
              + (f", / transformers {best.cpu_rate / hf.cpu_rate:.2f}x" if hf is not None else ""))
        if best.tokens != args.new_tokens * top:
            print(f"* note{which}: {best.tokens} tokens generated of {args.new_tokens * top} asked (some answers "
                  "ended at end-of-text)")
    if len(layouts) == 2:
        paged, slots = (layouts[k][1][top] for k in ("paged", "slots"))
        print(f"* paged / slots at {top} clients: {paged.rate / slots.rate:.2f}x (tokens/s)")


if __name__ == "__main__":
    main()
