"""aiayn's block-quantised matmul (``aiayn.fast.q4``) against the other ways to multiply by a
SmolLM2-135M projection on this CPU: ATen's int4 (bfloat16 activations) and int8 weight-only
kernels, ``F.linear`` in bfloat16 and float32, and for many rows dequantise + oneDNN float32.

Per number of rows, each way's time for the linear layers of one forward (4 shapes x 30 layers and
the output layer). The weights stay in cache: the kernels' compute cost, not a decode step's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from aiayn.fast.onednn import onednn_linear
from aiayn.fast.q4 import BlockWeight, quantize_blocks_q4
from aiayn.fast.q4_build import kernel_ops
from benchmarks import common

SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]  # (out, in, count)


def ways(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    ops = kernel_ops()
    n, k = w.shape
    q4 = quantize_blocks_q4(w)
    half = lambda t: t.half().float()  # noqa: E731 (Q4_1's float16 scales, as a GGUF file stores them)
    q41 = BlockWeight.from_values(q4.values(), half(q4.row_scales()[0]), half(q4.row_scales()[1]), offset=0,
                                  block=32, kind="Q4_1")
    q8 = BlockWeight.from_values((torch.randint(-127, 128, (n, k)) + 128).to(torch.uint8),
                                 half(torch.rand(n, k // 32) * 1e-2), None, offset=128, block=32, kind="Q8_0")
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.values().int(), 1)
    int4_scales = torch.stack([q4.row_scales()[0].T, q4.row_scales()[1].T], -1).bfloat16().contiguous()
    int8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    int8_scales = torch.rand(n, dtype=torch.bfloat16)
    xb, wb = x.bfloat16(), w.bfloat16()
    out: dict[str, Callable[[], object]] = {
        "aiayn Q4_1": lambda: ops.matmul(x, q41.q, q41.scale, q41.mins, 0, 32, True, n, k),
        "aiayn Q8_0": lambda: ops.matmul(x, q8.q, q8.scale, None, 128, 32, False, n, k),
        "ATen int4 (bf16)": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4, 32, int4_scales),
        "ATen int8 (bf16)": lambda: torch.ops.aten._weight_int8pack_mm(xb, int8, int8_scales),
        "F.linear bf16": lambda: F.linear(xb, wb),
        "F.linear f32": lambda: F.linear(x, w),
    }
    if x.shape[0] >= 64:
        out["dequantise + oneDNN f32"] = lambda: onednn_linear(x, q41.dequantize_rows())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.q4", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,512")
    common.add_clock_arg(parser)
    common.add_common_args(parser, repeats=5, warmup=1)  # --quick: only the first projection shape
    args = parser.parse_args(argv)
    if kernel_ops() is None:
        raise SystemExit("aiayn's 4-bit kernel could not be built here (a C++ compiler and ninja are needed)")
    common.setup(args)
    shapes = SHAPES[:1] if args.quick else SHAPES
    common.header(f"Block-quantised matmul against the other ways, SmolLM2-135M's linear layers, {args.clock} clock",
                  args)
    weights = [(torch.randn(n, k) * k ** -0.5, count) for n, k, count in shapes]
    for m in (int(r) for r in args.rows.split(",")):
        totals: dict[str, float] = {}
        with torch.inference_mode():
            for w, count in weights:
                x = torch.randn(m, w.shape[1])
                timed = [common.Timed(name, fn) for name, fn in ways(x, w).items()]
                common.measure(timed, args, round_seconds=0.02, clock=common.CLOCKS[args.clock])
                for t in timed:
                    totals[t.name] = totals.get(t.name, 0.0) + count * t.median
        base = totals["aiayn Q4_1"]
        print(f"| {m} rows | " + " | ".join(f"{name} {t * 1e3:.2f} ms ({t / base:.1f}x)" for name, t in totals.items())
              + " |", flush=True)
    common.footer()


if __name__ == "__main__":
    main()
