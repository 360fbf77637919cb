"""aiayn.fast's kernels one by one: each fast module against the plain module it replaces, on the
same inputs, in the same run, at 1 and at 2 threads: the measurement a kernel of ``aiayn/fast``
must pass to stay. The kernels (``KERNELS``; their cases in ``benchmarks/fast_cases.py``):
``linear-onednn`` (``FastLinear``'s oneDNN path, forward + backward), ``linear-transposed`` (the
turned-around (W x^T)^T on a decode step's few rows), ``attention-decode`` (single-query and GQA
fold), ``attention-block-causal`` and ``attention-dropout`` (training attention, forward +
backward), ``dropout``, ``fused-loss`` (the output layer fused with the loss) and
``compiled-matvec`` (the compiled decode step's linear layers; skipped by ``--quick`` and
``--no-compiled``).

Each case's plain and fast calls are interleaved (``benchmarks.common``) for ``--repeats`` rounds
of ~20 ms; "plain / fast" above 1 is the kernel's gain, below 1 the table says **does NOT win**;
"fast path" is the path the fast module takes on those inputs, "falls back" rows run the plain
function behind its dispatch.

    python -m benchmarks.fast                       # every kernel, 1 and 2 threads
    python -m benchmarks.fast --threads 1,2 --kernels dropout fused-loss
    python -m benchmarks.fast --quick               # smoke test: small shapes, no compiled step
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass

import torch

from benchmarks.common import Timed, footer, header, run_interleaved, table
from benchmarks.fast_cases import FACTORIES, FALLS_BACK, Case, Options

KERNELS = tuple(FACTORIES)  # in the order the benchmark runs them
TITLES = {
    "linear-onednn": "FastLinear, oneDNN path: training-size layers, forward + backward (vs nn.Linear)",
    "linear-transposed": "FastLinear, turned-around product (W x^T)^T: decode rows, no grad (vs nn.Linear)",
    "attention-decode": "fast_attention, single-query decode paths (vs scaled_dot_product_attention)",
    "attention-block-causal": "fast_attention, block-causal training path, forward + backward (vs SDPA is_causal)",
    "attention-dropout": "fast_attention, attention-weight dropout 0.1, forward + backward (vs SDPA's dropout)",
    "dropout": "FastDropout p 0.1, forward + backward (vs nn.Dropout)",
    "fused-loss": "FusedLossLinear: output layer + cross-entropy fused, forward + backward (vs logits + loss)",
    "compiled-matvec": "compiled decode step's linear layers, MatvecLinears (vs compiled F.linear)",
}
ROUND_SECONDS = 0.02  # each timed round runs enough calls to take about this long (--quick: 5 ms)


@dataclass
class Result:
    kernel: str
    case: str
    path: str
    threads: int
    plain: float  # seconds per call (median round)
    fast: float
    spread: float  # the larger (max - min) / median of the two

    @property
    def ratio(self) -> float:
        return self.plain / self.fast

    @property
    def judged(self) -> bool:
        """Whether this row measures a kernel (not a fallback to the plain function)."""
        return not self.path.startswith(FALLS_BACK)


def measure(kernel: str, case: Case, threads: int, *, repeats: int, warmup: int, round_seconds: float) -> Result:
    plain, fast = Timed("plain", case.plain), Timed("fast", case.fast)
    run_interleaved([plain, fast], repeats=repeats, warmup=warmup, round_seconds=round_seconds)
    return Result(kernel, case.name, case.path, threads, plain.median, fast.median, max(plain.spread, fast.spread))


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def verdict(r: Result) -> str:
    if not r.judged:
        return "no kernel (falls back)"
    noise = " (within the spread)" if abs(r.ratio - 1) < r.spread else ""
    return f"wins{noise}" if r.ratio >= 1 else f"**does NOT win**{noise}"


def report_kernel(kernel: str, results: list[Result]) -> None:
    print(f"### {kernel}: {TITLES[kernel]}\n")
    rows = [[r.case, r.path, r.threads, fmt_time(r.plain), fmt_time(r.fast), f"**{r.ratio:.2f}x**",
             f"±{r.spread * 50:.0f}%", verdict(r)] for r in results]
    print(table(["case", "fast path", "threads", "plain / call", "fast / call", "plain / fast", "spread",
                 "verdict"], rows))
    print()


def summary(results: list[Result], kernels: list[str], threads: list[int]) -> None:
    print("### Summary: plain / fast per kernel and thread count (cases where the kernel runs)\n")
    rows, losers = [], []
    for kernel in kernels:
        for n in threads:
            judged = [r for r in results if r.kernel == kernel and r.threads == n and r.judged]
            if not judged:
                continue
            ratios = [r.ratio for r in judged]
            geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
            lost = [r for r in judged if r.ratio < 1]
            losers += lost
            rows.append([kernel, n, len(judged), f"{min(ratios):.2f}x", f"{max(ratios):.2f}x", f"{geo:.2f}x",
                         "wins in every case" if not lost else f"**does NOT win in {len(lost)} of {len(judged)}**"])
    print(table(["kernel", "threads", "cases", "min", "max", "geometric mean", "verdict"], rows))
    print()
    if losers:
        print("Cases where the fast module is slower than the plain one it replaces (plain / fast < 1):\n")
        for r in losers:
            print(f"* {r.kernel}, {r.threads} thread{'s' * (r.threads > 1)}: {r.case} ({r.path}): "
                  f"**{r.ratio:.2f}x** (spread ±{r.spread * 50:.0f}%)")
    else:
        print("Every kernel wins in every measured case, at every thread count measured.")


def parse_threads(text: str) -> list[int]:
    try:
        threads = [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes counts like 1,2; got {text!r}") from None
    if not threads or min(threads) < 1:
        raise argparse.ArgumentTypeError(f"--threads takes counts >= 1 like 1,2; got {text!r}")
    return threads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fast", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=parse_threads, default=[1, 2],
                        help="torch intra-op thread counts, comma-separated (default 1,2)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                        help="which kernels (default all)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="interleaved rounds of plain and fast; the figure is their median (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls of each first (default 2)")
    parser.add_argument("--compiled-rows", type=int, nargs="+", default=[1, 2, 16],
                        help="rows of the compiled-matvec cases (default 1 2 16: each compiles twice per "
                             "thread count)")
    parser.add_argument("--no-compiled", action="store_true", help="skip compiled-matvec (it compiles)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke-test settings: small shapes, 2 rounds, 1 warm-up, 5 ms rounds, no "
                             "compiled-matvec unless named in --kernels (figures are rough)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kernels = list(args.kernels)
    round_seconds = ROUND_SECONDS
    if args.quick:
        args.repeats, args.warmup, round_seconds = min(args.repeats, 2), min(args.warmup, 1), ROUND_SECONDS / 4
        if args.kernels == list(KERNELS):
            kernels.remove("compiled-matvec")
    if args.no_compiled and "compiled-matvec" in kernels:
        kernels.remove("compiled-matvec")
    opt = Options(quick=args.quick, seed=args.seed, compiled_rows=args.compiled_rows)
    before = torch.get_num_threads()
    header("aiayn.fast kernels against the plain modules they replace", args)
    results: list[Result] = []
    for kernel in kernels:
        kernel_results: list[tuple[int, Result]] = []
        for n in args.threads:
            torch.set_num_threads(n)
            for index, case in enumerate(FACTORIES[kernel](opt)):
                kernel_results.append((index, measure(kernel, case, n, repeats=args.repeats, warmup=args.warmup,
                                                      round_seconds=round_seconds)))
        kernel_results.sort(key=lambda pair: pair[0])  # stable: each case's thread counts side by side
        report_kernel(kernel, [r for _, r in kernel_results])
        sys.stdout.flush()
        results += [r for _, r in kernel_results]
    summary(results, kernels, args.threads)
    torch.set_num_threads(max(args.threads))
    footer()
    torch.set_num_threads(before)


if __name__ == "__main__":
    main()
