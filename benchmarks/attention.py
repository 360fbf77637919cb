"""Attention cost as the sequence grows: aiayn's fused (SDPA), block-causal and reference paths.

Benchmark 4. ``scaled_dot_product_attention`` on q, k, v (1, 8 heads, n, 64), causal, float32, n =
256 ... 4096: median time of a forward (forward + backward with ``--backward``) and the peak memory
the call allocates. The reference (``need_weights=True``) materialises (b, h, n, n) matrices;
the fused kernel keeps O(n) memory; "block causal" (``--backward``) is what an optimized model
trains with up to ``block_causal.MAX_LENGTH``.
"""

from __future__ import annotations

import argparse

import torch

from aiayn.fast.block_causal import MAX_LENGTH, block_causal_attention
from aiayn.nn.attention import scaled_dot_product_attention
from benchmarks import common


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--backward", action="store_true", help="time forward + backward instead of forward")
    common.add_common_args(parser, repeats=5, warmup=1)
    args = parser.parse_args(argv)
    common.setup(args)
    lengths = [n for n in args.lengths if n <= 1024] if args.quick else args.lengths
    mode = "forward + backward" if args.backward else "forward"
    common.header(f"Attention, {mode}, batch 1 x {args.heads} heads x n x {args.head_dim}, causal", args)
    rows, previous = [], {}
    for n in lengths:
        shape = (1, args.heads, n, args.head_dim)
        q, k, v = (torch.randn(shape, requires_grad=args.backward) for _ in range(3))
        grad = torch.randn(shape)

        def call(impl: str, q=q, k=k, v=v, grad=grad):
            def attend() -> torch.Tensor:
                if impl == "block causal":
                    return block_causal_attention(q, k, v, scale=args.head_dim**-0.5)
                # fused: SDPA's kernel; reference: the equation written out (its weights dropped)
                return scaled_dot_product_attention(q, k, v, causal=True, need_weights=impl == "reference")[0]

            def run():
                if args.backward:
                    attend().backward(grad)
                    q.grad = k.grad = v.grad = None
                    return None
                with torch.no_grad():
                    return attend()
            return run

        peers = [common.Timed("fused", call("fused"))]
        if args.backward and n <= MAX_LENGTH:
            peers.append(common.Timed("block causal", call("block causal")))
        peers.append(common.Timed("reference", call("reference")))
        common.run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
        scores = args.heads * n * n * 4  # one (1, h, n, n) float32 matrix
        memory = {p.name: common.peak_bytes(p.fn) for p in peers}
        for p in peers:
            growth = f"{p.median / previous[p.name]:.1f}x" if p.name in previous else ""
            rows.append([n, p.name, f"{p.median * 1e3:.2f}", growth, common.mib(memory[p.name]),
                         f"{memory[p.name] / scores:.2f}"])
            previous[p.name] = p.median
        time = {p.name: p.median for p in peers}
        rows.append([n, "**fused saves**", f"{time['reference'] / time['fused']:.1f}x time", "",
                     f"{common.mib(memory['reference'] - memory['fused'])} MiB", ""])
        if "block causal" in time:
            rows.append([n, "**block causal vs fused**", f"{time['fused'] / time['block causal']:.2f}x speed",
                         "", f"{common.mib(memory['block causal'] - memory['fused'])} MiB more", ""])
    print(common.table(["n", "path", "ms (median)", "time vs n/2", "peak MiB allocated",
                 "peak / one n x n score matrix"], rows))
    print("\nPeak = bytes allocated by the call beyond its inputs (outputs included), from "
          "torch.profiler allocator events. O(n^2) work: time grows ~4x per doubling of n once "
          "the matrices dominate.")
    common.footer()


if __name__ == "__main__":
    main()
