"""A staggered-arrival workload on ``aiayn serve``'s engine, paged KV cache against fixed slots at
equal memory: SmolLM2-135M, requests arriving as a Poisson process with mixed prompt lengths (mostly
short, some long) and mixed answer lengths, greedy.

The KV budget is what ``--slots`` fixed slots of ``--context`` tokens take. The fixed slots
(``--kv-layout slots``) run at most that many requests at once, each holding a whole context; the
paged cache (``--kv-layout paged``) holds the same bytes in blocks of 16 tokens, so it runs up to
``--max-batch`` requests whose real lengths fit. Both engines get the same requests at the same
times (the engine runs in this process on its own thread, as ``aiayn serve`` runs it, fed
``Request``s directly: no HTTP). For each: throughput (answer tokens over the time from the first
arrival to the last token), time to first token p50 / p99, and the most requests running at once.
Goal (issue 35): paged >= 1.3x the fixed slots' throughput at equal memory.

Transformers' static batching on the same workload (the issue's other peer) is not measured here
yet: benchmarks/serve.py measures it on all-at-once batches.

    flock /tmp/aiayn-bench.lock python -m benchmarks.staggered
    python -m benchmarks.staggered --quick

Not a test: it prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
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


def run(engine, jobs: list[Job]) -> dict[str, float]:
    """Submit ``jobs`` on their schedule; wait for every answer. Figures of the run."""
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
    ttft = sorted(r.first_token_at - r.arrived for r in requests)
    return {"tokens": sum(tokens), "seconds": end - start, "tokens_per_s": sum(tokens) / (end - start),
            "ttft_p50": ttft[len(ttft) // 2], "ttft_p99": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "most_running": most}


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
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.answer = min(args.requests, 16), [8, 48]
    setup(args)
    from aiayn.serve.blocks import block_plan
    from aiayn.serve.engine import Engine, slot_plan

    torch.set_num_threads(1)  # the engine thread takes --threads (as aiayn serve does)
    lm = smollm2_text_model()
    budget = slot_plan(lm, max_batch=args.slots, context=args.context, budget=1 << 40, kv_cache=None).bytes_per_row
    budget *= args.slots
    plans = {"fixed slots": slot_plan(lm, max_batch=args.max_batch, context=args.context, budget=budget, kv_cache=None),
             "paged": block_plan(lm, max_batch=args.max_batch, context=args.context, budget=budget, kv_cache=None)}
    jobs = workload(args)
    mark_start(args)
    results = {}
    for label, plan in plans.items():
        print(plan.describe(budget), flush=True)
        engine = Engine(lm, plan, prefill_chunk=256, threads=args.threads)
        engine.start()
        try:
            run(engine, [Job(0.0, jobs[0].prompt[:32], 4)])  # warm-up (one-time costs)
            results[label] = run(engine, jobs)
        finally:
            engine.stop()
        r = results[label]
        print(f"{label}: {r['tokens']} tokens in {r['seconds']:.1f} s, {r['tokens_per_s']:.2f} tokens/s, "
              f"TTFT p50 {r['ttft_p50']:.2f} s p99 {r['ttft_p99']:.2f} s, at most {r['most_running']} running",
              flush=True)
    header(f"Staggered arrivals, SmolLM2-135M: {args.requests} requests at {args.rate:g}/s, prompts "
           f"{args.short[0]}-{args.short[1]} tokens ({args.long[0]}-{args.long[1]} for {args.long_share:.0%}), "
           f"answers {args.answer[0]}-{args.answer[1]}; KV budget = {args.slots} slots of {args.context} tokens", args)
    print(table(["KV layout", "answer tokens", "seconds", "tokens/s", "TTFT p50 s", "TTFT p99 s", "most running"],
                [[label, r["tokens"], f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.2f}", f"{r['ttft_p50']:.2f}",
                  f"{r['ttft_p99']:.2f}", r["most_running"]] for label, r in results.items()]))
    ratio = results["paged"]["tokens_per_s"] / results["fixed slots"]["tokens_per_s"]
    print(f"\npaged / fixed slots throughput at equal memory: **{ratio:.2f}x** (goal >= 1.3x: "
          f"{'met' if ratio >= 1.3 else 'MISSED'})")
    footer()


if __name__ == "__main__":
    main()
