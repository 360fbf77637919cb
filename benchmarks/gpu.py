"""aiayn on a GPU against its peers, every row in one run on one card.

(a) GPT-2 124M training, batch 8 x 1024, bf16 autocast: aiayn against transformers' GPT2LMHeadModel,
    each eager and compiled; tokens/s and MFU (6 N + 12 L d T FLOPs per token over ``--peak-tflops``).
(b) The paper's base encoder-decoder, 128 x (100 + 100) tokens, bf16 autocast: aiayn against
    torch.nn.Transformer of the same shape, eager and compiled.
(c) Greedy decoding of GPT-2 124M in bfloat16, batch 1 and 16, 256 new tokens after 16: aiayn
    eager and compiled against transformers' generate with its dynamic and its static (compiled) cache.
(d) ``--recipe-row``: ``aiayn train --recipe recipes/multi30k-en-de.yaml``, wall time and BLEU.

A row's peers are warmed up, then timed in interleaved rounds (device synchronised), medians; a
peer that fails or is not installed is a row and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

from aiayn import build_model
from aiayn.device import prepare, resolve, synchronize
from benchmarks import common, gpu_models

MISSING_TRANSFORMERS = common.not_installed("transformers", ImportError(name="transformers"))
GOALS = {"a": 1.3, "a_mfu": 0.45, "b": 1.2, "c_rate": 2000.0, "c": 1.5}  # the targets


@contextlib.contextmanager
def compile_backend(backend: str | None) -> Iterator[None]:
    """With ``backend``, every torch.compile of the run uses it (--smoke: "eager", seconds on a CPU)."""
    real = torch.compile

    def patched(model=None, **kwargs):
        kwargs.update(backend=backend, mode=None)
        return real(**kwargs) if model is None else real(model, **kwargs)

    with mock.patch.object(torch, "compile", patched) if backend else contextlib.nullcontext():
        yield


class Row:
    """The peers of one row: each built and timed, or its failure kept as one line."""

    def __init__(self, device: torch.device, repeats: int, warmup: int, *, profile: bool = False) -> None:
        self.device, self.repeats, self.warmup, self.profile = device, repeats, warmup, profile
        self.timed: list[common.Timed] = []
        self.failed: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.params: dict[str, int] = {}

    def add(self, name: str, build: Callable[[], tuple[Callable[[], object], int]], iters: int = 1) -> None:
        """``build() -> (call, parameters)``; the call is warmed up here (a compiled one compiles)."""
        try:
            fn, params = build()
            for _ in range(self.warmup):
                fn()
            synchronize(self.device)
        except Exception as exc:  # a peer that cannot run here: say so, measure the others
            self.failed[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            return
        self.timed.append(common.Timed(name, fn, iters=iters))
        self.params[name] = params

    def pair(self, name: str, build: Callable[[bool], tuple[Callable[[], object], int]], iters: int = 1, *,
             compiled: str | None = None, missing: bool = False) -> None:
        """``name`` and its compiled twin (``compiled``, default "NAME compiled"): ``build(False)``,
        ``build(True)``; both skipped with the not-installed row when ``missing``."""
        for flag, label in ((False, name), (True, compiled or f"{name} compiled")):
            if missing:
                self.skipped[label] = MISSING_TRANSFORMERS
            else:
                self.add(label, lambda f=flag: build(f), iters=iters)

    def run(self) -> dict[str, float]:
        """Interleaved rounds (the device synchronised around each) -> median seconds per call, by peer."""
        common.run_interleaved(self.timed, repeats=self.repeats, warmup=0, sync=lambda: synchronize(self.device))
        return {p.name: p.median for p in self.timed}

    def report(self, unit: str, tokens: int, extra: dict[str, dict[str, float]] | None = None) -> dict[str, float]:
        """The row's table (``extra``: more columns, by peer); -> tokens/s by peer."""
        extra = extra or {}
        headers = ["peer", "parameters", f"ms / {unit} (median)", "spread", "tokens/s", *extra]
        rows = [[p.name, common.fmt_int(self.params[p.name]), f"{p.median * 1e3:.1f}", f"±{p.spread * 50:.0f}%",
                 common.fmt_int(tokens / p.median), *(f"{c[p.name]:.3f}" if p.name in c else "-" for c in extra.values())]
                for p in self.timed]
        rows += [[name, "-", f"failed: {why}", *["-"] * (len(headers) - 3)] for name, why in self.failed.items()]
        rows += [[name, "-", f"skipped: {why}", *["-"] * (len(headers) - 3)] for name, why in self.skipped.items()]
        print(common.table(headers, rows) + "\n")
        if self.profile:
            for p in self.timed:
                print(f"### {p.name}: torch.profiler, one call after the timed rounds\n\n```text\n"
                      f"{common.top_ops(p.fn, self.device)}\n```\n", flush=True)
        return {p.name: tokens / p.median for p in self.timed}


def ratio(label: str, rates: dict[str, float], ours: str, theirs: str, target: float | None = None) -> None:
    """'label: ours / theirs = 1.23x (target >= 1.3x: met)', or why it is not measured."""
    missing = [name for name in (ours, theirs) if name not in rates]
    if missing:
        print(f"* {label}: {ours} / {theirs}: not measured ({', '.join(missing)} did not run)")
        return
    r = rates[ours] / rates[theirs]
    goal = "" if target is None else f" (goal >= {target:g}x: {'met' if r >= target else 'MISSED'})"
    print(f"* {label}: {ours} / {theirs} = **{r:.2f}x**{goal}")


def free(row: Row) -> None:
    row.timed.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def row_a(args: argparse.Namespace, plan: gpu_models.Plan, device: torch.device, transformers) -> None:
    batch, length = plan.train_batch
    vocab = plan.gpt[0]
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=torch.Generator().manual_seed(0)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (b, t)
    row = Row(device, args.repeats, args.warmup, profile=args.profile)

    def aiayn(compiled: bool):
        torch.manual_seed(0)
        model = build_model(gpu_models.gpt2_config(plan)).to(device).train()
        step = gpu_models.aiayn_step(model, gpu_models.make_adamw(model, device), (inputs,), targets, device, compiled=compiled)
        return step, common.count_params(model)

    def hf(compiled: bool):
        torch.manual_seed(0)
        model = gpu_models.hf_gpt2(transformers, plan).to(device).train()
        run = torch.compile(model) if compiled else model
        forward = lambda x: run(input_ids=x, use_cache=False).logits  # noqa: E731
        return gpu_models.logits_step(forward, gpu_models.make_adamw(model, device), (inputs, targets), device), common.count_params(model)

    row.pair("aiayn", aiayn, args.iters)
    row.pair("transformers", hf, args.iters, missing=transformers is None)
    seconds = row.run()
    peak, peak_note = gpu_models.peak_flops(device, args.peak_tflops)
    flops = gpu_models.gpt2_train_flops(plan, batch * length)
    print(f"## (a) GPT-2 training, d {plan.gpt[1]}, {plan.gpt[3]} layers, vocab {vocab:,}, batch {batch} x {length}, "
          f"{gpu_models.device_name(device)}\n")
    mfu = {name: flops / s / peak for name, s in seconds.items()} if peak else {}
    rates = row.report("step", batch * length, {"MFU": mfu})
    print(f"model FLOPs per step: {flops / 1e12:.2f} TFLOP (6 N + 12 L d T per token); peak: {peak_note}\n")
    ratio("(a) training tokens/s, eager", rates, "aiayn", "transformers")
    ratio("(a) training tokens/s, compiled", rates, "aiayn compiled", "transformers compiled", GOALS["a"])
    if "aiayn compiled" in mfu:
        verdict = "met" if mfu["aiayn compiled"] >= GOALS["a_mfu"] else "MISSED"
        print(f"* (a) MFU of aiayn compiled = **{mfu['aiayn compiled']:.3f}** (goal >= {GOALS['a_mfu']}: {verdict})")
    else:
        print(f"* (a) MFU of aiayn compiled: not measured ({peak_note if not peak else 'it did not run'})")
    free(row)


def row_b(args: argparse.Namespace, plan: gpu_models.Plan, device: torch.device) -> None:
    batch, src_len, tgt_len = plan.seq2seq_batch
    config = gpu_models.seq2seq_config(plan, args.dropout)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, config.vocab_size, (batch, src_len), generator=g).to(device)  # no padding
    tgt = torch.randint(3, config.vocab_size, (batch, tgt_len + 1), generator=g).to(device)
    data = (src, tgt[:, :-1], tgt[:, 1:])  # source, target in, target out
    row = Row(device, args.repeats, args.warmup, profile=args.profile)

    def aiayn(compiled: bool):
        torch.manual_seed(0)
        model = build_model(config).to(device).train()
        step = gpu_models.aiayn_step(model, gpu_models.make_adamw(model, device), data[:2], data[2], device, compiled=compiled)
        return step, common.count_params(model)

    def reference(compiled: bool):
        torch.manual_seed(0)
        model = gpu_models.torch_seq2seq(config).to(device).train()
        run = torch.compile(model) if compiled else model
        return gpu_models.logits_step(run, gpu_models.make_adamw(model, device), data, device), common.count_params(model)

    row.pair("aiayn", aiayn, args.iters)
    row.pair("torch.nn.Transformer", reference, args.iters)
    row.run()
    tokens = batch * (src_len + tgt_len)
    print(f"## (b) encoder-decoder `{plan.seq2seq}` (d {config.d_model}, {config.n_layers}+{config.n_decoder_layers} "
          f"layers, vocab {config.vocab_size:,}), batch {batch} x ({src_len} + {tgt_len}) tokens, "
          f"{gpu_models.device_name(device)}\n")
    rates = row.report("step", tokens)
    ratio("(b) training tokens/s, eager", rates, "aiayn", "torch.nn.Transformer")
    ratio("(b) training tokens/s, compiled", rates, "aiayn compiled", "torch.nn.Transformer compiled", GOALS["b"])
    free(row)


def row_c(args: argparse.Namespace, plan: gpu_models.Plan, device: torch.device, transformers) -> None:
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if transformers is not None:  # the same weights on both sides: aiayn's model converted from HF's
        from aiayn.interop import from_hf_model

        hf = gpu_models.hf_gpt2(transformers, plan).eval()
        model = from_hf_model(hf)[0].to(device, dtype).eval()
        hf = hf.to(device, dtype)
    else:
        model, hf = build_model(gpu_models.gpt2_config(plan)).to(device, dtype).eval(), None
    print(f"## (c) greedy decoding, GPT-2 (d {plan.gpt[1]}, {plan.gpt[3]} layers), bfloat16, "
          f"{plan.new_tokens} new tokens after a {plan.prompt_len}-token prompt, {gpu_models.device_name(device)}\n")
    if hf is not None and device.type != "cuda":
        print(f"(transformers compiles its static-cache step on CUDA only: on {device.type} that row ran uncompiled)\n")
    for b in plan.decode_batches:
        decode_batch(args, plan, device, transformers, model, hf, b)


def decode_batch(args: argparse.Namespace, plan: gpu_models.Plan, device: torch.device, transformers, model: torch.nn.Module,
                 hf: torch.nn.Module | None, b: int) -> None:
    """Row (c) at batch ``b``: every decoder from the same random prompt (b, prompt_len)."""
    n = plan.new_tokens
    prompt = torch.randint(0, plan.gpt[0], (b, plan.prompt_len), generator=torch.Generator().manual_seed(b))
    prompt = prompt.to(device)
    row = Row(device, args.repeats, args.warmup, profile=args.profile)
    params = common.count_params(model)
    row.pair("aiayn", lambda c: (gpu_models.aiayn_decode(model, prompt, n, compile=c), params))
    row.pair("transformers", lambda s: (gpu_models.hf_decode(transformers, hf, prompt, n, static=s), params),
             compiled="transformers static + compile", missing=hf is None)
    row.run()
    print(f"batch {b}:\n")
    rates = row.report("call", b * n)
    ratio(f"(c) decode tokens/s, batch {b}, eager", rates, "aiayn", "transformers")
    ratio(f"(c) decode tokens/s, batch {b}, compiled", rates, "aiayn compiled", "transformers static + compile",
          GOALS["c"] if b == 1 else None)
    if b == 1:
        best = max((rates[k] for k in ("aiayn", "aiayn compiled") if k in rates), default=None)
        verdict = "not measured" if best is None else ("met" if best >= GOALS["c_rate"] else "MISSED")
        shown = "-" if best is None else common.fmt_int(best)
        print(f"* (c) aiayn batch 1 = **{shown}** tokens/s (goal >= {GOALS['c_rate']:,.0f}: {verdict})")
    if "aiayn" in rates and "transformers" in rates:
        calls = {p.name: p.fn for p in row.timed}
        same = torch.equal(calls["aiayn"](), calls["transformers"]())
        print(f"* greedy tokens, aiayn vs transformers (same weights): {'identical' if same else 'differ'}")
    print()
    free(row)


def row_d(args: argparse.Namespace, device: torch.device) -> None:
    print(f"## (d) `aiayn train --recipe {gpu_models.RECIPE} --device {device}`\n")
    with tempfile.TemporaryDirectory(prefix="aiayn-recipe-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "aiayn", "train", "--recipe", gpu_models.RECIPE, "--device", str(device),
                   "--run-dir", str(run_dir)]
        result = gpu_models.run_recipe(command, run_dir, args.recipe_timeout)
    print(f"command: {' '.join(command[1:])}\n")
    if result.bleu is None:
        print(f"* (d) failed (exit {result.returncode}, {result.seconds:.0f} s):\n```\n{result.tail}\n```")
        return
    minutes = result.seconds / 60
    close = abs(result.bleu - gpu_models.CPU_RECIPE_BLEU) <= gpu_models.SEED_SPREAD
    print(f"* (d) wall time **{minutes:.1f} min** (goal <= {gpu_models.RECIPE_MINUTES:g}: "
          f"{'met' if minutes <= gpu_models.RECIPE_MINUTES else 'MISSED'}); test2016 BLEU **{result.bleu:.2f}** against the "
          f"CPU run's {gpu_models.CPU_RECIPE_BLEU} (goal: within its seed spread {gpu_models.SEED_SPREAD}: {'met' if close else 'MISSED'})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (the first CUDA GPU, else the CPU), cpu, cuda, cuda:N")
    parser.add_argument("--rows", default="abc", help="which of the rows a, b, c to run (default abc)")
    parser.add_argument("--recipe-row", action="store_true", help="also row (d): the Multi30k recipe (minutes)")
    parser.add_argument("--recipe-timeout", type=float, default=1800.0, help="seconds row (d) may take")
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak, for MFU (default: by name)")
    parser.add_argument("--dropout", type=float, default=0.0, help="every dropout of row (b), both peers (default 0)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per peer first; compiles (default 2)")
    parser.add_argument("--iters", type=int, default=3, help="training steps per timed round (default 3)")
    parser.add_argument("--profile", action="store_true",
                        help="after each row, every peer's op table from torch.profiler (one call), and "
                             "torch.compile's hints (recompiles, skipped CUDA graphs) as they happen")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, 2 rounds, torch.compile with the eager backend: seconds on a CPU")
    args = parser.parse_args(argv)
    unknown = set(args.rows) - set("abc")
    if unknown:
        parser.error(f"--rows: unknown row(s) {', '.join(sorted(unknown))}; give some of a, b, c")
    plan = gpu_models.SMOKE if args.smoke else gpu_models.FULL
    if args.smoke:
        args.repeats, args.warmup, args.iters = min(args.repeats, 2), min(args.warmup, 1), 1
    device = prepare(resolve(args.device))
    if args.profile:  # what TORCH_LOGS=perf_hints,recompiles prints: why a graph recompiles or skips CUDA graphs
        torch._logging.set_logs(perf_hints=True, recompiles=True)
    threads = torch.get_num_threads()
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: one thread is fastest, and steady beside other jobs
    try:
        run_rows(args, plan, device)
    finally:
        torch.set_num_threads(threads)
        if args.profile:
            torch._logging.set_logs()  # back to the defaults (TORCH_LOGS's)


def run_rows(args: argparse.Namespace, plan: gpu_models.Plan, device: torch.device) -> None:
    transformers = common.load_peer("transformers", common.quiet_transformers)  # None: its peers are skipped
    common.header(f"aiayn GPU benchmark{' (--smoke: tiny sizes, figures meaningless)' if args.smoke else ''}: "
           f"{gpu_models.device_name(device)} ({device}); transformers "
           f"{transformers.__version__ if transformers else 'not installed: its peers are skipped'}", args,
           dtype="bf16 autocast, decoding in bfloat16")
    rows = {"a": lambda: row_a(args, plan, device, transformers), "b": lambda: row_b(args, plan, device),
            "c": lambda: row_c(args, plan, device, transformers)}
    with compile_backend("eager" if args.smoke else None):
        for name in "abc":
            if name in args.rows:
                rows[name]()
                print(flush=True)
    if args.recipe_row:
        row_d(args, device)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
