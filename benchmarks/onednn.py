"""float32 linear layers: aiayn's oneDNN path against ``F.linear`` (MKL), side by side.

The measurement behind ``aiayn.fast.onednn``: for each training-benchmark projection (4,096 rows),
the forward, input gradient and weight gradient both ways, interleaved; plus the 2048^3 product.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from aiayn.fast import onednn
from benchmarks.common import Timed, add_common_args, footer, header, run_interleaved, setup, table

# (in_features, out_features) of the decoder benchmark's layers (d 256, d_ff 1024, vocab 8,000)
SHAPES = [(256, 768), (256, 256), (256, 1024), (1024, 256), (256, 8000)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.onednn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    add_common_args(parser, repeats=7, warmup=2)
    args = parser.parse_args(argv)
    setup(args)
    if not onednn.available():
        print("this torch build has no oneDNN linear op: nothing to compare")
        return
    rows_n = min(args.rows, 512) if args.quick else args.rows
    header(f"float32 products, {rows_n} rows: F.linear / torch.mm (MKL) against oneDNN", args)
    rows = []
    square = 1024 if args.quick else 2048
    a, b = torch.randn(square, square), torch.randn(square, square)
    cases = [(f"{square}^3 square", "a b", 2 * square**3, lambda: torch.mm(a, b), lambda: onednn.matmul(a, b))]
    for i, o in SHAPES:
        x, w, g = torch.randn(rows_n, i), torch.randn(o, i), torch.randn(rows_n, o)
        flops = 2 * rows_n * i * o
        cases += [
            (f"{i} -> {o}", "forward x W^T", flops, lambda x=x, w=w: F.linear(x, w),
             lambda x=x, w=w: onednn.linear_product(x, w)),
            (f"{i} -> {o}", "input grad g W", flops, lambda g=g, w=w: g @ w,
             lambda g=g, w=w: onednn.linear_product(g, w.t())),
            (f"{i} -> {o}", "weight grad g^T x", flops, lambda g=g, x=x: g.t() @ x,
             lambda g=g, x=x: onednn.weight_gradient(g, x)),
        ]
    for shape, product, flops, mkl, dnnl in cases:
        peers = [Timed("mkl", mkl), Timed("onednn", dnnl)]
        run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
        speed = {p.name: flops / p.median / 1e9 for p in peers}
        rows.append([shape, product, f"{speed['mkl']:.0f}", f"{speed['onednn']:.0f}",
                     f"**{speed['onednn'] / speed['mkl']:.2f}x**"])
    print(table(["shape (in -> out)", "product", "F.linear / torch.mm GFLOP/s", "oneDNN GFLOP/s",
                 "oneDNN / MKL"], rows))
    print("\nThe weight gradient through oneDNN is computed with the smaller weight dimension as "
          "the product's rows (``onednn.weight_gradient``), the faster way round measured here.")
    footer()


if __name__ == "__main__":
    main()
