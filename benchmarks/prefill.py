"""Where a long prompt's prefill time goes: SmolLM2-135M-Instruct float32, one prompt of ``--tokens``
random tokens. Peers, interleaved: ``aiayn serve``'s engine (paged, chunks of ``--prefill-chunk``)
to its first token, with and without ``aiayn.fast.prefill_attention``; one plain forward (the lower
bound); transformers' forward from the same GGUF. Then the engine's time in its linear layers and
attention, summed in situ.
"""

from __future__ import annotations

import argparse
import collections
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.staggered import Job, greedy_request, hf_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, repeats=5, warmup=1)
    parser.add_argument("--tokens", type=int, default=900, help="prompt tokens (default 900)")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="the engine's chunk (default 256)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.prefill_chunk < 1:
        parser.error("--tokens and --prefill-chunk must be >= 1")
    common.setup(args)
    from aiayn.fast import switch
    from aiayn.serve.blocks import block_plan
    from aiayn.serve.engine import Engine, slot_plan

    torch.set_grad_enabled(False)
    lm = common.smollm2_text_model()
    if args.tokens + 1 > lm.model.config.max_seq_len:
        parser.error(f"--tokens must be below the model's {lm.model.config.max_seq_len} positions")
    hf = None if args.no_hf else common.load_peer("transformers", hf_model)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]  # as benchmarks.staggered's
    context = 1 << (args.tokens + 1).bit_length()  # a row long enough for the prompt
    budget = slot_plan(lm, max_batch=1, context=context, budget=1 << 40, kv_cache=None).bytes_per_row
    plan = block_plan(lm, max_batch=1, context=context, budget=budget, kv_cache=None)
    def engine(prepared: bool) -> Callable[[], int]:
        def prefill() -> int:
            with switch.without(*(() if prepared else ("prefill_attention",))):
                engine = Engine(lm, plan, prefill_chunk=args.prefill_chunk, threads=args.threads)
                first: list[int] = []
                engine.submit(greedy_request(Job(0.0, prompt, 1), lambda event: first.append(event.token)))
                while engine.running or engine.waiting:
                    engine.step()
                return first[0]
        return prefill

    def plain() -> int:
        with torch.inference_mode():
            out = lm.model(torch.tensor([prompt]))
            return int(out.head(out.hidden_rows[:, -1]).argmax())

    def transformers_forward() -> int:
        with torch.inference_mode():
            return int(hf(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].argmax())

    peers = {"engine, paged": engine(True), "engine, paged, plain chunk attention": engine(False),
             "plain forward": plain}
    if hf is not None:
        peers["transformers forward"] = transformers_forward
    common.mark_start(args)
    tokens = {name: fn() for name, fn in peers.items()}  # each peer's first token (a first warm-up call)
    timed = [common.Timed(name, fn) for name, fn in peers.items()]
    common.measure(timed, args, warmup=max(0, args.warmup - 1))
    inside = in_situ(peers["engine, paged"])
    common.header(f"Prefill of one {args.tokens}-token prompt, SmolLM2-135M-Instruct float32 (engine chunks of "
           f"{args.prefill_chunk})", args)
    print(common.table(["peer", "seconds (median)", "range", "tokens/s", "first token"],
                       [[p.name, f"{p.median:.3f}", f"{min(p.times):.3f}-{max(p.times):.3f}",
                         f"{args.tokens / p.median:.0f}", tokens[p.name]] for p in timed]))
    total = inside.pop("total")
    print(f"\nInside one engine prefill ({total:.3f} s): "
          + ", ".join(f"{name} {s:.3f} s ({s / total:.0%})" for name, s in inside.items())
          + f", the rest {total - sum(inside.values()):.3f} s")
    common.footer()


def in_situ(prefill: Callable[[], int]) -> dict[str, float]:
    """One run of ``prefill`` with the seconds spent in linear layers (``F.linear`` and aiayn's
    oneDNN / turned-around products) and in ``F.scaled_dot_product_attention`` summed."""
    import aiayn.fast.linear as fast_linear
    import aiayn.fast.prefill_attention as chunk_attention
    import aiayn.nn.attention as attention

    spent: collections.Counter[str] = collections.Counter()

    def timed(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return call

    linear, sdpa = fast_linear.FastLinear.forward, F.scaled_dot_product_attention
    fast_linear.FastLinear.forward = timed("linear layers", linear)  # type: ignore[method-assign]
    chunk_attention.F.scaled_dot_product_attention = attention.F.scaled_dot_product_attention = timed("attention (SDPA)", sdpa)
    try:
        start = time.perf_counter()
        prefill()
        spent["total"] = time.perf_counter() - start
    finally:
        fast_linear.FastLinear.forward = linear  # type: ignore[method-assign]
        chunk_attention.F.scaled_dot_product_attention = attention.F.scaled_dot_product_attention = sdpa
    return dict(spent)


if __name__ == "__main__":
    main()
