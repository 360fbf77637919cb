"""Time to first token of a repeated long prefix: SmolLM2-135M in ``aiayn serve``'s engine (in this
process), a ``--prefix``-token prefix and a short question, then the same prefix and another
question, with the prefix cache (paged layout) on and off. Each round takes a fresh prefix; figures
are medians over ``--repeats`` rounds. Goal: repeat TTFT <= 0.3x the first's.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import common
from benchmarks.staggered import Job, run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, repeats=3, warmup=1)
    parser.add_argument("--prefix", type=int, default=1700, help="shared prefix tokens (default 1700)")
    parser.add_argument("--question", type=int, default=24, help="tokens after the prefix (default 24)")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    common.setup(args)
    from aiayn.serve.blocks import block_plan
    from aiayn.serve.engine import Engine

    torch.set_num_threads(1)  # the engine thread takes --threads (as aiayn serve does)
    lm = common.smollm2_text_model()
    context = args.prefix + args.question + 8
    g = torch.Generator().manual_seed(args.seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    def first_token_seconds(engine, prompt: list[int]) -> float:  # one greedy token, from its arrival
        return run(engine, [Job(0.0, prompt, 1)])["ttft_p50"]

    common.mark_start(args)
    results: dict[str, dict[str, list[float]]] = {}
    for caching in (True, False):
        plan = block_plan(lm, max_batch=4, context=context, budget=1 << 30, kv_cache=None,
                          block_size=args.block_size, prefix_caching=caching)
        engine = Engine(lm, plan, prefill_chunk=512, threads=args.threads)
        engine.start()
        try:
            first_token_seconds(engine, tokens(args.prefix + args.question))  # warm-up (one-time costs)
            times: dict[str, list[float]] = {"first": [], "repeat": []}
            for _ in range(args.repeats):
                prefix = tokens(args.prefix)
                times["first"].append(first_token_seconds(engine, prefix + tokens(args.question)))
                times["repeat"].append(first_token_seconds(engine, prefix + tokens(args.question)))
                print(f"prefix caching {'on' if caching else 'off'}: first {times['first'][-1]:.2f} s, "
                      f"repeat {times['repeat'][-1]:.2f} s", flush=True)
        finally:
            engine.stop()
        results["on" if caching else "off"] = times
    common.header(f"Time to first token, SmolLM2-135M: a {args.prefix}-token shared prefix + {args.question} tokens, "
           f"first request and a repeat (blocks of {args.block_size})", args)
    print(common.table(["engine", "first TTFT s", "repeat TTFT s", "repeat / first"],
                       [[f"prefix caching {label}", common.spread_text(t["first"], 2), common.spread_text(t["repeat"], 2),
                         f"{common.median_ratio(t['repeat'], t['first']):.2f}x"] for label, t in results.items()]))
    ratio = common.median_ratio(results["on"]["repeat"], results["on"]["first"])
    print(f"\nrepeat / first with the prefix cache: **{ratio:.2f}x** (goal <= 0.3x: "
          f"{'met' if ratio <= 0.3 else 'MISSED'})")
    common.footer()


if __name__ == "__main__":
    main()
