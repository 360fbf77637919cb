"""The output layer + cross-entropy, forward and backward: aiayn's fused version
(``aiayn.fast.fused_loss``, what ``aiayn train`` runs) against ``F.linear`` then
``F.cross_entropy`` (what the peers run), time and peak memory.

Output layers d 256 -> 8,000 and SmolLM2's 576 -> 49,152, over 4,096 tokens; peak memory is what
the call allocates beyond its inputs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from aiayn.fast.fused_loss import linear_cross_entropy
from benchmarks import common

SHAPES = {"decoder benchmark (256 -> 8,000)": (4096, 256, 8000),
          "SmolLM2-135M (576 -> 49,152)": (4096, 576, 49152)}
QUICK_SHAPES = {"small (64 -> 1,000)": (512, 64, 1000)}


def steps(n: int, d: int, v: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).requires_grad_()
    weight = (torch.randn(v, d, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)

    def unfused() -> None:
        F.cross_entropy(F.linear(hidden, weight), targets).backward()
        hidden.grad = weight.grad = None

    def fused() -> None:
        linear_cross_entropy(hidden, weight, None, targets).nll_sum.backward()
        hidden.grad = weight.grad = None

    return unfused, fused


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loss", description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, repeats=5, warmup=1)
    args = parser.parse_args(argv)
    common.setup(args)
    common.mark_start(args)
    common.header("Output layer + cross-entropy, forward + backward, float32", args)
    rows, lines = [], []
    for label, (n, d, v) in (QUICK_SHAPES if args.quick else SHAPES).items():
        unfused, fused = steps(n, d, v, args.seed)
        peers = [common.Timed("F.linear + F.cross_entropy", unfused), common.Timed("aiayn fused", fused)]
        common.run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
        peaks = [common.peak_bytes(p.fn) for p in peers]
        for p, peak in zip(peers, peaks, strict=True):
            rows.append([label, f"{n:,} x {d} -> {v:,}", p.name, f"{p.median * 1e3:.1f}", f"±{p.spread:.0%}",
                         common.mib(peak)])
        lines.append(f"* {label}: aiayn fused **{peers[0].median / peers[1].median:.2f}x** the speed, "
                     f"{peaks[0] / max(peaks[1], 1):.1f}x less peak memory")
    print(common.table(["output layer", "tokens x d -> classes", "way", "ms (median)", "spread", "peak MiB"], rows))
    print("\n" + "\n".join(lines))
    common.footer()


if __name__ == "__main__":
    main()
