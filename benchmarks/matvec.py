"""Linear layers on a few rows, the decode step's matrix-vector products: how fast each way reads
the weights. SmolLM2-135M's projections (30 layers and the output layer), per weight dtype: eager
and compiled ``F.linear``, compiled multiply + sum, compiled and eager (W x^T)^T. These ratios set
``MATVEC_MAX_ROWS``, ``TRANSPOSED_MAX_ROWS`` and ``EAGER_TRANSPOSED_ROWS`` ("aiayn's choice").
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.fast.matvec import (
    matvec_linear,
    transposed_linear,
    use_eager_transposed,
    use_matvec,
    use_transposed,
)
from benchmarks import common


class Projections(nn.Module):
    """Every projection of a LLaMA-style decoder as aiayn stores it: (out, in) weights."""

    def __init__(self, *, d_model: int, d_ff: int, kv_width: int, n_layers: int, vocab: int | None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        layer = [(d_model + 2 * kv_width, d_model), (d_model, d_model), (2 * d_ff, d_model), (d_model, d_ff)]
        shapes = layer * n_layers + ([(vocab, d_model)] if vocab else [])  # (vocab None: no output layer)
        self.linears = nn.ModuleList(nn.Linear(i, o, bias=False, dtype=dtype) for o, i in shapes)
        self.requires_grad_(False)

    def forward(self, xs: list[Tensor]) -> list[Tensor]:
        return [F.linear(x, lin.weight) for x, lin in zip(xs, self.linears, strict=True)]  # each (rows, o)

    def nbytes(self) -> int:
        return sum(lin.weight.numel() * lin.weight.element_size() for lin in self.linears)


def each_by(way: Callable[[Tensor, Tensor], Tensor], model: Projections) -> Callable[[list[Tensor]], list[Tensor]]:
    def run(xs: list[Tensor]) -> list[Tensor]:
        return [way(x, lin.weight) for x, lin in zip(xs, model.linears, strict=True)]
    return run


def compiled(fn: Callable[[list[Tensor]], object]) -> Callable[[list[Tensor]], object]:
    """``fn`` compiled (static shapes), called with Inductor's freezing on, as aiayn's decode step is."""
    compiled_fn = torch.compile(fn, fullgraph=True, dynamic=False)

    def run(xs: list[Tensor]) -> object:
        with inductor_config.patch(freezing=True), torch.inference_mode():
            return compiled_fn(xs)
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.matvec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=30)
    common.add_common_args(parser, repeats=5, warmup=2)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.layers = [1], min(args.layers, 6)
    common.setup(args)
    common.mark_start(args)
    common.header(f"Linear layers on few rows: SmolLM2-135M's projections ({args.layers} layers + output layer)", args)
    rows_out = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model = Projections(d_model=576, d_ff=1536, kv_width=192, n_layers=args.layers, vocab=49152,
                            dtype=dtype).eval()
        nbytes = model.nbytes()
        for rows in args.rows:
            torch._dynamo.reset()  # a fresh compile per shape; earlier graphs' frozen copies freed
            xs = [torch.randn(rows, lin.in_features, dtype=dtype) for lin in model.linears]
            ways = {
                "eager F.linear": torch.inference_mode()(model),
                "compiled F.linear": compiled(model),
                "compiled multiply + sum": compiled(each_by(matvec_linear, model)),
                "compiled (W x^T)^T": compiled(each_by(transposed_linear, model)),
                "eager (W x^T)^T": torch.inference_mode()(each_by(transposed_linear, model)),
            }
            timed = [common.Timed(name, partial(fn, xs)) for name, fn in ways.items()]
            common.run_interleaved(timed, repeats=args.repeats, warmup=args.warmup)
            base = next(t.median for t in timed if t.name == "compiled F.linear")
            x, w = xs[0], model.linears[0].weight
            chosen = {"compiled multiply + sum" if use_matvec(x, w) else
                      "compiled (W x^T)^T" if use_transposed(x, w) else "compiled F.linear",
                      "eager (W x^T)^T" if use_eager_transposed(x, w) else "eager F.linear"}
            for t in timed:
                rows_out.append([dtype_name, rows, t.name, f"{t.median * 1e3:.2f}", f"{nbytes / t.median / 1e9:.1f}",
                                 f"{base / t.median:.2f}x", "**yes**" if t.name in chosen else ""])
    print(common.table(["dtype", "rows", "way", "ms per pass", "weight GB/s", "speed vs compiled F.linear", "aiayn's choice"], rows_out))
    common.footer()


if __name__ == "__main__":
    main()
