"""What paging costs a decode step: SmolLM2-135M's one-token step over ``PagedKVCache`` against
``RowKVCache`` (fixed slots, read in place), at batch 1, 4 and 16 and contexts of 256 to 2,048
tokens held per row. The paged cache is read two ways, side by side: "gather" (each layer gathers
the rows' blocks into SDPA's layout, the plain path) and "kernel" (``aiayn.fast.paged_attention``:
attention reads the blocks in place through the block table).

The model is loaded as ``aiayn serve`` runs it (float32, aiayn.fast's kernels). Each row holds
``context`` tokens: one row is prefilled (in chunks of 512), and the other rows are copies of it
(``RowKVCache.reorder``) or share its blocks (``PagedKVCache.adopt``): what a row holds does not
change a step's cost. Then decode steps (one token per row, counts told to the cache as the
engine does) are timed, the two layouts interleaved (benchmarks/common.py's method).

    flock /tmp/aiayn-bench.lock python -m benchmarks.paged_kv_cache
    python -m benchmarks.paged_kv_cache --quick --contexts 256 1024

Not a test: it prints figures and the paged / slots ratios of the step time; it asserts nothing.
(Batch 1 reads one row whose blocks are consecutive: the plain path views the pool without a
copy and the kernel does not apply, so its two paged columns run the same code.)
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from aiayn.fast import switch
from aiayn.fast.paged_attention_build import kernel_ops
from aiayn.generate.step import decode_step
from benchmarks.common import (
    Timed,
    add_common_args,
    footer,
    header,
    mark_start,
    run_interleaved,
    setup,
    smollm2_text_model,
    table,
)

STEPS_PER_ROUND = 4


def filled_caches(model: torch.nn.Module, batch: int, context: int, block_size: int, steps: int):
    """A RowKVCache and two PagedKVCaches of ``batch`` rows each holding ``context`` tokens, with
    room for ``steps`` more per row."""
    prompt = torch.randint(3, 40000, (1, context), generator=torch.Generator().manual_seed(0))
    max_len = context + steps
    rows = model.new_cache(1, max_len, per_row=True)
    blocks_per_row = -(-max_len // block_size)
    paged = [model.new_cache(batch, max_len, per_row=True, block_size=block_size,
                             n_blocks=1 + context // block_size + batch * (blocks_per_row - context // block_size + 1))
             for _ in range(2)]
    for cache in (rows, *paged):
        view = cache.rows(0, 1)
        for start in range(0, context, 512):
            chunk = prompt[:, start: start + 512]
            decode_step(model, chunk, view.expect([chunk.shape[1]]))
            view = cache.rows(0, 1)
    rows.reorder([0] * batch)
    for cache in paged:
        shared = cache.table(0)
        for row in range(1, batch):
            cache.adopt(row, shared)
    return rows, *paged


def step(model: torch.nn.Module, cache, batch: int, *, gather: bool = False) -> None:
    """One decode step of every row (``gather``: the paged cache read by the plain gather)."""
    tokens = torch.full((batch, 1), 7, dtype=torch.long)
    view = cache.rows(0, batch).expect([1] * batch)
    with switch.without("paged_attention") if gather else contextlib.nullcontext():
        decode_step(model, tokens, view, valid=torch.ones_like(tokens, dtype=torch.bool))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, repeats=5, warmup=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    setup(args)

    model = smollm2_text_model().model
    if kernel_ops() is None:
        raise SystemExit("the paged-attention kernel did not build (a C++ compiler and ninja are needed)")
    torch.set_grad_enabled(False)
    mark_start(args)
    rows_out = []
    for batch in args.batches:
        for context in args.contexts:
            steps = (args.warmup + args.repeats) * STEPS_PER_ROUND
            with torch.inference_mode():
                fixed, gathered, kernel = filled_caches(model, batch, context, args.block_size, steps)
                peers = [Timed("slots", lambda c=fixed, b=batch: step(model, c, b), iters=STEPS_PER_ROUND),
                         Timed("gather", lambda c=gathered, b=batch: step(model, c, b, gather=True),
                               iters=STEPS_PER_ROUND),
                         Timed("kernel", lambda c=kernel, b=batch: step(model, c, b), iters=STEPS_PER_ROUND)]
                run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
            slots_ms, gather_ms, kernel_ms = (p.median * 1e3 for p in peers)
            rows_out.append([batch, context, f"{slots_ms:.1f}", f"{gather_ms:.1f}", f"{kernel_ms:.1f}",
                             f"{gather_ms / slots_ms:.2f}x", f"{kernel_ms / slots_ms:.2f}x",
                             f"{max(p.spread for p in peers):.0%}"])
            print(f"batch {batch}, context {context}: slots {slots_ms:.1f} ms, paged gather {gather_ms:.1f} ms, "
                  f"paged kernel {kernel_ms:.1f} ms", flush=True)
    header(f"Decode step, SmolLM2-135M: paged KV cache (blocks of {args.block_size}) vs fixed slots", args)
    print(table(["batch", "context held", "slots ms/step", "paged gather ms/step", "paged kernel ms/step",
                 "gather / slots", "kernel / slots", "spread"], rows_out))
    footer()


if __name__ == "__main__":
    main()
