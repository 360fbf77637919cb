"""A staggered-arrival workload on ``aiayn serve``'s engine: the paged KV cache against fixed slots
at equal memory, and against Hugging Face transformers' static batching, in one run. SmolLM2-135M,
requests arriving as a Poisson process with mixed prompt lengths (mostly short, some long) and mixed
answer lengths, greedy.

The KV budget is what ``--slots`` fixed slots of ``--context`` tokens take. The fixed slots
(``--kv-layout slots``) run at most that many requests at once, each holding a whole context; the
paged cache (``--kv-layout paged``) holds the same bytes in blocks of 16 tokens, so it runs up to
``--max-batch`` requests whose real lengths fit. Both engines get the same requests at the same
times (the engine runs in this process on its own thread, as ``aiayn serve`` runs it, fed
``Request``s directly: no HTTP).

transformers (the issue's other peer): ``AutoModelForCausalLM`` from the same GGUF file (the same
weights, dequantised to float32: its logits equal aiayn's), the same requests at the same times,
greedy, the same ``--threads``, static batching: it waits until ``--hf-batch`` requests have
arrived (or the last one has), left-pads their prompts and runs one ``generate`` to the batch's
longest answer (every row to the end: a row whose own ``max_tokens`` is shorter gets its answer
when the batch ends), then takes the next batch of the requests waiting. ``--hf-batch`` defaults to
``--slots``: a batch of padded rows of at most ``--context`` tokens each, so the same memory. Its
time to first token is from a request's arrival to its batch's first new token (a streamer times
it); its answer tokens are each row's own, up to its ``max_tokens`` or end-of-text (as the engine
counts them).

For each: throughput (answer tokens over the time from the start of the schedule to the last
token), time to first token p50 / p99, and the most requests running at once. ``--repeats N``
runs the three N times, interleaved (slots, paged, transformers, slots, ...); the table has every
run and the ratios are medians over the rounds with their range. Goals (issue 35): paged >= 1.3x
the fixed slots' and >= 1.5x transformers' static batch throughput at equal memory, TTFT p99 <= 2 s
(the paged engine here serves up to ``--max-batch`` (16) requests at once). ``--gather-row`` adds
the paged engine without ``aiayn.fast``'s paged-attention kernel (every row's blocks gathered for
SDPA, as before the kernel) to each round.

    flock /tmp/aiayn-bench.lock python -m benchmarks.staggered
    python -m benchmarks.staggered --quick

Not a test: it prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from benchmarks.common import (
    add_common_args,
    footer,
    header,
    mark_start,
    setup,
    smollm2_text_model,
    table,
)

HF = "transformers static batch"
SLOTS, PAGED, GATHER = "fixed slots", "paged", "paged, gather (no paged-attention kernel)"


@dataclass
class Job:
    at: float  # seconds after the start
    prompt: list[int]
    answer: int  # max_tokens


def workload(args: argparse.Namespace) -> list[Job]:
    """``--requests`` jobs: exponential gaps of mean 1 / ``--rate`` s; a prompt of ``--long`` tokens
    with probability ``--long-share``, else ``--short``; answers of ``--answer`` tokens (ranges)."""
    rng = random.Random(args.seed)
    jobs, at = [], 0.0
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        low, high = args.long if rng.random() < args.long_share else args.short
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(low, high))]
        jobs.append(Job(at, prompt, rng.randint(*args.answer)))
    return jobs


def figures(tokens: int, seconds: float, ttft: list[float], most: int, failed: int = 0) -> dict[str, float]:
    """One run's figures: throughput, TTFT p50 / p99 (``ttft`` in seconds, one per request answered),
    and how many requests failed (an engine error: no token)."""
    ttft = sorted(ttft) or [float("nan")]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_p50": ttft[len(ttft) // 2], "ttft_p99": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "most_running": most, "failed": failed}


def run(engine, jobs: list[Job]) -> dict[str, float]:
    """Submit ``jobs`` to the engine on their schedule; wait for every answer. Figures of the run."""
    from aiayn.generate import SamplingConfig
    from aiayn.serve.engine import Request, SamplingParams

    done = threading.Semaphore(0)
    requests, tokens = [], [0] * len(jobs)
    most = 0
    start = time.monotonic()
    for i, job in enumerate(jobs):
        time.sleep(max(0.0, start + job.at - time.monotonic()))

        def sink(event, i=i) -> None:
            tokens[i] += 1
            if event.finish_reason:
                done.release()

        # min_tokens is not an engine option: a long answer is what max_tokens asks, and SmolLM2 on
        # random token prompts rarely ends early; the tokens actually generated are what is counted.
        request = Request(job.prompt, SamplingParams(max_tokens=job.answer, sampling=SamplingConfig(temperature=0.0)),
                          sink)
        engine.submit(request)
        requests.append(request)
        most = max(most, engine.running)
    for _ in jobs:
        while not done.acquire(timeout=0.05):
            most = max(most, engine.running)
    end = max(r.last_token_at for r in requests)
    answered = [r for r in requests if r.first_token_at is not None]
    return figures(sum(tokens), end - start, [r.first_token_at - r.arrived for r in answered], most,
                   len(requests) - len(answered))


def hf_model():  # -> a transformers LlamaForCausalLM, float32, SmolLM2's GGUF weights
    """SmolLM2-135M-Instruct in transformers, from the GGUF file ``smollm2_text_model`` reads."""
    import transformers
    from transformers.utils import logging as hf_logging

    from aiayn.interop.gguf import smollm2_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    path = smollm2_path()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def static_batches(model, jobs: list[Job], batch: int, eos_id: int | None, threads: int) -> dict[str, float]:
    """transformers' static batching on ``jobs``' schedule: wait for ``batch`` arrivals (or the
    last), ``generate`` them together to the longest answer, then the next ``batch`` waiting.
    Runs on this thread with ``threads`` torch threads (given back after)."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """The time of the batch's first new token (``generate`` puts the prompt first)."""

        def __init__(self) -> None:
            self.puts, self.at = 0, 0.0

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.at = time.monotonic()

        def end(self) -> None:
            pass

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    tokens, ttft, end = 0, [], 0.0
    start = time.monotonic()
    try:
        for first in range(0, len(jobs), batch):
            group = jobs[first: first + batch]
            time.sleep(max(0.0, start + group[-1].at - time.monotonic()))  # the batch is full
            width = max(len(j.prompt) for j in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)  # (b, width), left-padded with 0
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, job in enumerate(group):
                ids[row, width - len(job.prompt):] = torch.tensor(job.prompt)
                mask[row, width - len(job.prompt):] = 1
            streamer = FirstToken()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max(j.answer for j in group),
                                     do_sample=False, eos_token_id=eos_id, pad_token_id=0, streamer=streamer)
            end = time.monotonic()
            for row, job in enumerate(group):
                answer = out[row, width:].tolist()[: job.answer]
                if eos_id in answer:
                    answer = answer[: answer.index(eos_id) + 1]  # end-of-text counts, as the engine's
                tokens += len(answer)
                ttft.append(streamer.at - (start + job.at))
    finally:
        torch.set_num_threads(before)
    return figures(tokens, end - start, ttft, batch)


def spread_line(label: str, ratios: list[float], goal: float | None) -> str:
    """'label: **median x** (range a-b over n rounds; goal >= g: met)' (no goal: no verdict)."""
    mid = statistics.median(ratios)
    span = f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds" if len(ratios) > 1 else "1 round"
    verdict = "" if goal is None else f"; goal >= {goal}x: {'met' if mid >= goal else 'MISSED'}"
    return f"* {label}: **{mid:.2f}x** ({span}{verdict})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, repeats=1, warmup=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (default 1)")
    parser.add_argument("--short", type=int, nargs=2, default=[16, 128], help="short prompt tokens, min max")
    parser.add_argument("--long", type=int, nargs=2, default=[512, 900], help="long prompt tokens, min max")
    parser.add_argument("--long-share", type=float, default=0.2)
    parser.add_argument("--answer", type=int, nargs=2, default=[16, 96], help="answer tokens, min max")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=4, help="the budget: this many fixed slots of --context")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--hf-batch", type=int, help="transformers' static batch size (default: --slots, equal memory)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--gather-row", action="store_true",
                        help="add the paged engine without the paged-attention kernel (gather + SDPA)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.answer = min(args.requests, 16), [8, 48]
    args.hf_batch = args.hf_batch or args.slots
    setup(args)
    from aiayn.cpu_share import keep_thread_count
    from aiayn.nn.attention import MultiHeadAttention
    from aiayn.serve.blocks import block_plan
    from aiayn.serve.engine import Engine, slot_plan

    keep_thread_count()  # every peer on --threads, whatever other aiayn jobs run (aiayn/cpu_share.py)
    torch.set_num_threads(1)  # the engine thread takes --threads (as aiayn serve does)
    lm = smollm2_text_model()
    hf = None if args.no_hf else hf_model()
    budget = slot_plan(lm, max_batch=args.slots, context=args.context, budget=1 << 40, kv_cache=None).bytes_per_row
    budget *= args.slots
    plans = {SLOTS: slot_plan(lm, max_batch=args.max_batch, context=args.context, budget=budget, kv_cache=None),
             PAGED: block_plan(lm, max_batch=args.max_batch, context=args.context, budget=budget, kv_cache=None)}
    if args.gather_row:
        plans[GATHER] = plans[PAGED]
    kernels = {m: m.cache_kernel for m in lm.model.modules() if isinstance(m, MultiHeadAttention)}
    for plan in plans.values():
        print(plan.describe(budget), flush=True)
    jobs = workload(args)
    if hf is not None:
        static_batches(hf, [Job(0.0, jobs[0].prompt[:32], 4)], 1, lm.eos_id, args.threads)  # warm-up
    mark_start(args)
    results: list[tuple[str, dict[str, float]]] = []
    for _ in range(args.repeats):
        for label, plan in plans.items():
            for module, kernel in kernels.items():
                module.cache_kernel = None if label == GATHER else kernel
            engine = Engine(lm, plan, prefill_chunk=256, threads=args.threads)
            engine.start()
            try:
                run(engine, [Job(0.0, jobs[0].prompt[:32], 4)])  # warm-up (one-time costs)
                results.append((label, run(engine, jobs)))
            finally:
                engine.stop()
                for module, kernel in kernels.items():
                    module.cache_kernel = kernel
            report(label, results[-1][1])
        if hf is not None:
            results.append((HF, static_batches(hf, jobs, args.hf_batch, lm.eos_id, args.threads)))
            report(f"{HF} of {args.hf_batch}", results[-1][1])
    offered = sum(j.answer for j in jobs) / jobs[-1].at
    header(f"Staggered arrivals, SmolLM2-135M: {args.requests} requests at {args.rate:g}/s, prompts "
           f"{args.short[0]}-{args.short[1]} tokens ({args.long[0]}-{args.long[1]} for {args.long_share:.0%}), "
           f"answers {args.answer[0]}-{args.answer[1]} (offered: {offered:.1f} answer tokens/s over the "
           f"arrivals); KV budget = {args.slots} slots of {args.context} tokens; {args.threads} thread(s)", args)
    print(table(["peer", "answer tokens", "seconds", "tokens/s", "TTFT p50 s", "TTFT p99 s", "most running", "failed"],
                [[label if label != HF else f"{HF} of {args.hf_batch}", r["tokens"], f"{r['seconds']:.1f}",
                  f"{r['tokens_per_s']:.2f}", f"{r['ttft_p50']:.2f}", f"{r['ttft_p99']:.2f}", r["most_running"], r["failed"]]
                 for label, r in results]))
    rounds = [dict(results[k: k + len(results) // args.repeats])
              for k in range(0, len(results), len(results) // args.repeats)]
    print()
    print(spread_line("paged / fixed slots throughput at equal memory",
                      [r[PAGED]["tokens_per_s"] / r[SLOTS]["tokens_per_s"] for r in rounds], 1.3))
    if hf is not None:
        print(spread_line(f"paged / {HF} of {args.hf_batch} throughput",
                          [r[PAGED]["tokens_per_s"] / r[HF]["tokens_per_s"] for r in rounds], 1.5))
    if args.gather_row:
        print(spread_line("paged with the kernel / paged, gather", [r[PAGED]["tokens_per_s"] / r[GATHER]["tokens_per_s"]
                                                                   for r in rounds], None))
    p99 = [r[PAGED]["ttft_p99"] for r in rounds]
    print(f"* paged TTFT p99 (up to {args.max_batch} at once): **{statistics.median(p99):.2f} s** "
          f"({', '.join(f'{p:.2f}' for p in p99)}; goal <= 2 s: {'met' if statistics.median(p99) <= 2 else 'MISSED'})")
    footer()


def report(label: str, r: dict[str, float]) -> None:
    print(f"{label}: {r['tokens']} tokens in {r['seconds']:.1f} s, {r['tokens_per_s']:.2f} tokens/s, TTFT p50 "
          f"{r['ttft_p50']:.2f} s p99 {r['ttft_p99']:.2f} s, at most {r['most_running']} running, {r['failed']} failed (load average "
          f"{os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
