"""A staggered-arrival workload on ``aiayn serve``'s engine: the paged KV cache against fixed slots
at equal memory, and against Hugging Face transformers' static batching, in one run. SmolLM2-135M,
Poisson arrivals of mixed prompt lengths (mostly short, some long) and answer lengths, greedy.

The KV budget is ``--slots`` fixed slots of ``--context`` tokens; the paged cache holds the same
bytes in blocks of 16 and runs up to ``--max-batch`` requests. The engine runs in this process (no
HTTP). transformers (the same GGUF weights) waits for ``--hf-batch`` arrivals, left-pads them and
runs one ``generate``; its TTFT runs from arrival to its batch's first token. The arrival rate is
``--load`` of the fixed slots' capacity, measured first on the requests all at once. ``--clock cpu``
steps the engine on a clock of its CPU seconds (``run_stepped``), so other jobs do not change the
figures. ``--ttft-breakdown`` splits TTFT into queued, behind (admission to first prefill forward)
and prefill. Goals: paged >= 1.3x fixed slots' and >= 1.5x transformers' throughput, TTFT p99 <= 2 s.

    python -m benchmarks.staggered --ttft-breakdown --saturated
    python -m benchmarks.staggered --clock cpu --threads 1 --ttft-breakdown --saturated
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks import common

HF = "transformers static batch"
SLOTS, PAGED = "fixed slots", "paged"


@dataclass
class Job:
    at: float  # seconds after the start
    prompt: list[int]
    answer: int  # max_tokens


def workload(args: argparse.Namespace, rate: float) -> list[Job]:
    """``--requests`` jobs, exponential gaps of mean 1 / ``rate`` s, prompt and answer lengths drawn
    from their ranges; the same ``--seed`` gives the same jobs at any rate (gaps scale as 1 / rate)."""
    rng = random.Random(args.seed)
    jobs, at = [], 0.0
    for _ in range(args.requests):
        at += rng.expovariate(rate)
        low, high = args.long if rng.random() < args.long_share else args.short
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(low, high))]
        jobs.append(Job(at, prompt, rng.randint(*args.answer)))
    return jobs


def all_at_once(jobs: list[Job]) -> list[Job]:
    """The same requests, every one arriving at the start (a saturating load: the capacity run)."""
    return [Job(0.0, job.prompt, job.answer) for job in jobs]


PARTS = ("queued", "behind", "prefill")  # where a request's TTFT goes (see the module docstring)


def figures(tokens: int, seconds: float, ttft: list[float], most: int, failed: int = 0,
            parts: list[tuple[float, float, float]] | None = None) -> dict[str, float]:
    """One run's figures: throughput, TTFT p50 / p99 (s, per answered request), failures, and with
    ``parts`` (queued, behind, prefill s per request) each part's mean over all and over the slowest
    tenth by TTFT (``queued_tail``)."""
    order = sorted(range(len(ttft)), key=ttft.__getitem__)
    ranked = [ttft[i] for i in order] or [float("nan")]
    out = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
           "ttft_p50": ranked[len(ranked) // 2], "ttft_p99": ranked[min(len(ranked) - 1, round(0.99 * (len(ranked) - 1)))],
           "most_running": most, "failed": failed}
    if parts:
        out["ttft_mean"] = statistics.fmean(ttft)
        tail = [parts[i] for i in order[-max(1, len(order) // 10):]]
        for k, name in enumerate(PARTS):
            out[name] = statistics.fmean(p[k] for p in parts)
            out[f"{name}_tail"] = statistics.fmean(p[k] for p in tail)
    return out


def greedy_request(job: Job, sink: Callable):  # -> aiayn.serve.engine.Request
    """The engine request of ``job``: greedy, ``job.answer`` tokens at most (the tokens made are counted)."""
    from aiayn.generate import SamplingConfig
    from aiayn.serve.engine import Request, SamplingParams

    return Request(job.prompt, SamplingParams(max_tokens=job.answer, sampling=SamplingConfig(temperature=0.0)), sink)


def run(engine, jobs: list[Job]) -> dict[str, float]:
    """Submit ``jobs`` to the engine on their schedule; wait for every answer. Figures of the run."""
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

        request = greedy_request(job, sink)
        engine.submit(request)
        requests.append(request)
        most = max(most, engine.running)
    for _ in jobs:
        while not done.acquire(timeout=0.05):
            most = max(most, engine.running)
    end = max(r.last_token_at for r in requests)
    answered = [r for r in requests if r.first_token_at is not None]
    parts = [(r.admitted_at - r.arrived, r.prefill_at - r.admitted_at, r.first_token_at - r.prefill_at)
             for r in answered]
    return figures(sum(tokens), end - start, [r.first_token_at - r.arrived for r in answered], most,
                   len(requests) - len(answered), parts)


def run_stepped(engine, jobs: list[Job], threads: int) -> dict[str, float]:
    """``--clock cpu``: the engine stepped on this thread on a clock that advances by each step's
    CPU seconds (``time.process_time``) and jumps to the next arrival when idle. Admission and
    prefill are stamped at a step's start, a first token at its end; other jobs on the machine only
    stretch the wall time."""
    torch.set_num_threads(threads)
    tokens, requests, marks = [0] * len(jobs), [], []  # marks: [admitted, prefill, first token, last token]
    clock, most, arrived = 0.0, 0, 0
    while arrived < len(jobs) or engine.running or engine.waiting:
        if not (engine.running or engine.waiting) and clock < jobs[arrived].at:
            clock = jobs[arrived].at  # idle until the next arrival
        while arrived < len(jobs) and jobs[arrived].at <= clock:
            job = jobs[arrived]

            def sink(event, i=arrived) -> None:
                tokens[i] += 1

            requests.append(greedy_request(job, sink))
            marks.append([None] * 4)
            engine.submit(requests[-1])
            arrived += 1
        seen = [(r.admitted_at, r.prefill_at, r.first_token_at, r.last_token_at) for r in requests]
        before = time.process_time()
        engine.step()
        end = clock + time.process_time() - before
        for r, mark, old in zip(requests, marks, seen, strict=True):
            new = (r.admitted_at, r.prefill_at, r.first_token_at, r.last_token_at)
            for k, (was, now) in enumerate(zip(old, new, strict=True)):
                if now != was and (mark[k] is None or k == 3):
                    mark[k] = clock if k < 2 else end
        clock = end
        most = max(most, engine.running)
    answered = [(job, m) for job, m in zip(jobs, marks, strict=True) if m[2] is not None]
    parts = [(m[0] - job.at, m[1] - m[0], m[2] - m[1]) for job, m in answered]
    return figures(sum(tokens), max(m[3] for _, m in answered), [m[2] - job.at for job, m in answered], most,
                   len(jobs) - len(answered), parts)


def hf_model():  # -> a transformers LlamaForCausalLM, float32, SmolLM2's GGUF weights
    """SmolLM2-135M-Instruct in transformers, from the GGUF file ``smollm2_text_model`` reads."""
    warnings.filterwarnings("ignore")
    return common.hf_causal_lm(common.smollm2())


def static_batches(model, jobs: list[Job], batch: int, eos_id: int | None, threads: int,
                   cpu_clock: bool = False) -> dict[str, float]:
    """transformers' static batching on ``jobs``' schedule: wait for ``batch`` arrivals (or the last),
    ``generate`` them together to the longest answer, then the next batch, on ``threads`` threads.
    ``cpu_clock``: on ``run_stepped``'s clock (a batch lasts its ``generate``'s CPU seconds), no sleep."""
    from transformers.generation.streamers import BaseStreamer

    now = time.process_time if cpu_clock else time.monotonic

    class FirstToken(BaseStreamer):
        """The time of the batch's first new token (``generate`` puts the prompt first)."""

        def __init__(self) -> None:
            self.puts, self.at = 0, 0.0

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.at = now()

        def end(self) -> None:
            pass

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    tokens, ttft, parts, end = 0, [], [], 0.0
    start = time.monotonic()
    try:
        for first in range(0, len(jobs), batch):
            group = jobs[first: first + batch]
            if cpu_clock:
                began = max(end, group[-1].at)  # (seconds on the clock)
            else:
                time.sleep(max(0.0, start + group[-1].at - time.monotonic()))  # the batch is full
                began = time.monotonic() - start
            width = max(len(j.prompt) for j in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)  # (b, width), left-padded with 0
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, job in enumerate(group):
                ids[row, width - len(job.prompt):] = torch.tensor(job.prompt)
                mask[row, width - len(job.prompt):] = 1
            streamer, origin = FirstToken(), now()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max(j.answer for j in group),
                                     do_sample=False, eos_token_id=eos_id, pad_token_id=0, streamer=streamer)
            end, first_token = began + now() - origin, began + streamer.at - origin
            for row, job in enumerate(group):
                answer = out[row, width:].tolist()[: job.answer]
                if eos_id in answer:
                    answer = answer[: answer.index(eos_id) + 1]  # end-of-text counts, as the engine's
                tokens += len(answer)
                ttft.append(first_token - job.at)
                parts.append((began - job.at, 0.0, first_token - began))  # (one forward: no "behind")
    finally:
        torch.set_num_threads(before)
    return figures(tokens, end, ttft, batch, parts=parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.staggered", description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, repeats=1, warmup=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--load", type=float, default=0.75,
                        help="the arrival rate as a share of the fixed slots' measured capacity (default 0.75)")
    parser.add_argument("--rate", type=float, help="mean arrivals per second (default: from --load)")
    parser.add_argument("--capacity", type=float,
                        help="the fixed slots' capacity in answer tokens/s (default: measured, all at once)")
    parser.add_argument("--saturated", action="store_true",
                        help="also run every peer on the requests all at once (their capacities)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: the engine on its thread, requests on the wall clock; cpu: the engine stepped "
                             "on a clock of CPU seconds (run_stepped: figures the machine's load does not change)")
    parser.add_argument("--ttft-breakdown", action="store_true", help="where each peer's time to first token went")
    parser.add_argument("--short", type=int, nargs=2, default=[16, 128], help="short prompt tokens, min max")
    parser.add_argument("--long", type=int, nargs=2, default=[512, 900], help="long prompt tokens, min max")
    parser.add_argument("--long-share", type=float, default=0.2)
    parser.add_argument("--answer", type=int, nargs=2, default=[16, 96], help="answer tokens, min max")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=4, help="the budget: this many fixed slots of --context")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, help="transformers' static batch size (default: --slots, equal memory)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.answer = min(args.requests, 16), [8, 48]
    if args.load <= 0 or (args.rate is not None and args.rate <= 0) or (args.capacity or 1) <= 0:
        parser.error("--load, --rate and --capacity must be > 0")
    args.hf_batch = args.hf_batch or args.slots
    return args


def engine_run(lm, plan, jobs: list[Job], args: argparse.Namespace) -> dict[str, float]:
    """One run of the engine with ``plan`` on ``jobs`` (after a warm-up request), on ``--clock``."""
    from aiayn.serve.engine import Engine

    engine = Engine(lm, plan, prefill_chunk=args.prefill_chunk, threads=args.threads)
    warm_up = [Job(0.0, [100 + i for i in range(32)], 4)]  # (one-time costs)
    try:
        if args.clock == "cpu":
            run_stepped(engine, warm_up, args.threads)
            result = run_stepped(engine, jobs, args.threads)
        else:
            engine.start()
            run(engine, warm_up)
            result = run(engine, jobs)
    finally:
        engine.stop()
        torch.set_num_threads(1)
    result["preemptions"] = engine.metrics.preemptions._value.get()
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common.setup(args)
    from aiayn.cpu_share import keep_thread_count
    from aiayn.serve.blocks import block_plan
    from aiayn.serve.engine import slot_plan

    keep_thread_count()  # every peer on --threads, whatever other aiayn jobs run (aiayn/cpu_share.py)
    torch.set_num_threads(1)  # the engine thread takes --threads (as aiayn serve does)
    lm = common.smollm2_text_model()
    hf = None if args.no_hf else common.load_peer("transformers", hf_model)
    budget = slot_plan(lm, max_batch=args.slots, context=args.context, budget=1 << 40, kv_cache=None).bytes_per_row
    budget *= args.slots
    plans = {SLOTS: slot_plan(lm, max_batch=args.max_batch, context=args.context, budget=budget, kv_cache=None),
             PAGED: block_plan(lm, max_batch=args.max_batch, context=args.context, budget=budget, kv_cache=None)}
    for plan in plans.values():
        print(plan.describe(budget), flush=True)
    if hf is not None:
        static_batches(hf, [Job(0.0, [100 + i for i in range(32)], 4)], 1, lm.eos_id, args.threads)  # warm-up

    peers = {label: lambda jobs, plan=plan: engine_run(lm, plan, jobs, args) for label, plan in plans.items()}
    if hf is not None:
        peers[HF] = lambda jobs: static_batches(hf, jobs, args.hf_batch, lm.eos_id, args.threads, args.clock == "cpu")
    rounds(args, peers)


def rounds(args: argparse.Namespace, peers: dict[str, Callable[[list[Job]], dict[str, float]]]) -> None:
    """The fixed slots' capacity (unless given), then ``--repeats`` interleaved rounds of every peer."""
    common.mark_start(args)
    cpu = args.clock == "cpu"
    unit = workload(args, 1.0)  # the requests; their arrival times at 1/s, scaled below
    mean_answer = statistics.fmean(j.answer for j in unit)
    capacity = args.capacity
    if capacity is None:
        measured = peers[SLOTS](all_at_once(unit))
        report(f"{SLOTS}, all at once (capacity)", measured)
        capacity = measured["tokens_per_s"]
    rate = args.rate or args.load * capacity / mean_answer
    jobs = [Job(j.at / rate, j.prompt, j.answer) for j in unit]
    offered = rate * mean_answer
    print(f"arrival rate {rate:.3g}/s: offered {offered:.2f} answer tokens/s = {offered / capacity:.0%} of the fixed "
          f"slots' capacity ({capacity:.2f} tokens/s{' measured' if args.capacity is None else ', given'})", flush=True)

    results: list[tuple[str, dict[str, float]]] = []
    saturated: list[tuple[str, dict[str, float]]] = []
    name = {HF: f"{HF} of {args.hf_batch}"}
    for _ in range(args.repeats):
        for label, peer in peers.items():
            results.append((label, peer(jobs)))
            report(name.get(label, label), results[-1][1])
            if args.saturated:
                saturated.append((label, peer(all_at_once(jobs))))
                report(f"{name.get(label, label)}, all at once", saturated[-1][1])
    common.header(f"Staggered arrivals, SmolLM2-135M: {args.requests} requests at {rate:.3g}/s (offered {offered:.1f} answer "
           f"tokens/s = {offered / capacity:.0%} of the fixed slots' capacity, {capacity:.1f} tokens/s), prompts "
           f"{args.short[0]}-{args.short[1]} tokens ({args.long[0]}-{args.long[1]} for {args.long_share:.0%}), "
           f"answers {args.answer[0]}-{args.answer[1]}; KV budget = {args.slots} slots of {args.context} tokens; "
           f"--prefill-chunk {args.prefill_chunk}; {args.threads} thread(s); "
           + ("clock: CPU seconds of the stepped engine (--clock cpu)" if cpu else "clock: wall"), args)
    summary(args, results, "")
    if saturated:
        print("\n### The same requests all at once (each peer's capacity)\n")
        summary(args, saturated, " all at once")
    common.footer()


def summary(args: argparse.Namespace, results: list[tuple[str, dict[str, float]]], how: str) -> None:
    """The runs' table, the breakdown with ``--ttft-breakdown``, and the ratios against the goals."""
    name = {HF: f"{HF} of {args.hf_batch}"}
    print(common.table(["peer", "answer tokens", "seconds", "tokens/s", "TTFT p50 s", "TTFT p99 s", "most running",
                 "preempted", "failed"],
                [[name.get(label, label), r["tokens"], f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.2f}",
                  f"{r['ttft_p50']:.2f}", f"{r['ttft_p99']:.2f}", r["most_running"], int(r.get("preemptions", 0)),
                  r["failed"]] for label, r in results]))
    if args.ttft_breakdown:
        print("\nWhere the time to first token went (s; mean over all requests / over the slowest tenth):\n")
        print(common.table(["peer", "TTFT", *PARTS],
                    [[name.get(label, label), f"{r['ttft_p50']:.2f} p50 / {r['ttft_p99']:.2f} p99",
                      *(f"{r[p]:.2f} / {r[p + '_tail']:.2f}" for p in PARTS)] for label, r in results]))
    per_round = len(results) // args.repeats
    rounds = [dict(results[k: k + per_round]) for k in range(0, len(results), per_round)]
    print()
    print(common.spread_line(f"paged / fixed slots throughput at equal memory{how}",
                      [r[PAGED]["tokens_per_s"] / r[SLOTS]["tokens_per_s"] for r in rounds], 1.3))
    if HF in rounds[0]:
        print(common.spread_line(f"paged / {HF} of {args.hf_batch} throughput{how}",
                          [r[PAGED]["tokens_per_s"] / r[HF]["tokens_per_s"] for r in rounds], 1.5))
    p99 = [r[PAGED]["ttft_p99"] for r in rounds]
    print(f"* paged TTFT p99{how} (up to {args.max_batch} at once): **{statistics.median(p99):.2f} s** "
          f"({', '.join(f'{p:.2f}' for p in p99)}; goal <= 2 s: {'met' if statistics.median(p99) <= 2 else 'MISSED'})")


def report(label: str, r: dict[str, float]) -> None:
    print(f"{label}: {r['tokens']} tokens in {r['seconds']:.1f} s, {r['tokens_per_s']:.2f} tokens/s, TTFT p50 "
          f"{r['ttft_p50']:.2f} s p99 {r['ttft_p99']:.2f} s, at most {r['most_running']} running, "
          f"{int(r.get('preemptions', 0))} preempted, {r['failed']} failed (load average "
          f"{os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
