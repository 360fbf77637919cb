"""Training throughput: forward + backward + Adam step, tokens/s, aiayn against its peers.

Benchmark 1 (``--suite small`` / ``paper-base``): aiayn, torch.nn.Transformer, BART and
x-transformers' XTransformer, batch 32 x (32 + 32) tokens, random right padding. Benchmark 2
(``--suite decoder``): d 256, 4 layers, batch 16 x 256, against GPT-2 and x-transformers.

aiayn's rows: "aiayn" is ``optimize(model, "train")`` with ``padding_free`` and ``sequence_loss``;
"aiayn compiled" the same under ``torch.compile``; "aiayn plain torch" without ``optimize``; "aiayn
padded" / "aiayn logits" make (b, t, v) logits for the peers' ``F.cross_entropy``. Same Adam, dropout
and batch for all; tokens/s counts padding. FLOPs are counted on plain twins of aiayn's models
(attention not counted); MFU is against the measured 2048^3 ``torch.mm`` and oneDNN rates.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from aiayn.models import ModelOutput
from aiayn.train.losses import sequence_loss
from benchmarks import common
from benchmarks.peers import (
    LM_PEERS,
    SEQ2SEQ_PEERS,
    SEQ2SEQ_SIZES,
    Dropouts,
    LMSize,
    aiayn_padded_seq2seq,
    aiayn_seq2seq,
    lm_logits,
    optimize_aiayn,
    quiet,
)

TRAINING_TARGET = 1.2
COMPILED = "aiayn compiled"  # the optimized aiayn model under torch.compile (aiayn train --compile)
UNFUSED = "aiayn logits"  # the optimized aiayn decoder making its logits for the shared F.cross_entropy
PLAIN = "aiayn plain torch"  # the aiayn model without aiayn.fast.optimize (aiayn train --plain): MKL, SDPA
PADDED = "aiayn padded"  # the optimized aiayn model computing its padding and logits (F.cross_entropy)

# Decoder-only training peers: aiayn (output layer fused with its loss), the same through logits, the others.
LM_TRAIN_PEERS = {"aiayn": LM_PEERS["aiayn"], UNFUSED: LM_PEERS["aiayn"],
                  **{name: build for name, build in LM_PEERS.items() if name != "aiayn"}}
# aiayn's rows (optimized for training, but PLAIN); SEQUENCE_LOSS_ROWS take aiayn train's loss.
AIAYN_ROWS = ("aiayn", COMPILED, PLAIN, PADDED, UNFUSED)
SEQUENCE_LOSS_ROWS = ("aiayn", COMPILED, PLAIN)
MFU_TARGET = 0.6


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The same Adam for every peer: torch's fused kernel, its fastest on CPU."""
    return torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)


def padded_batch(batch: int, length: int, vocab: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random ids in [3, vocab) right-padded with 0 to ``length``; lengths in [length/2, length]."""
    tokens = torch.randint(3, vocab, (batch, length), generator=gen)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    lengths[0] = length  # the longest row fills the batch
    valid = torch.arange(length)[None, :] < lengths[:, None]
    return tokens.masked_fill(~valid, 0), valid


def logits_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The peers' loss: ``F.cross_entropy`` over (b, t, v) logits, padding (-100) ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def make_step(model: nn.Module, forward, targets: Tensor, *, sequence: bool):
    """One training step of ``model`` on ``forward(model)``: ``aiayn train``'s ``sequence_loss`` with
    ``sequence``, else the peers' logits and ``F.cross_entropy``."""
    opt = make_optimizer(model)

    def step() -> None:
        out = forward(model)
        if sequence:  # float32, as every peer (aiayn train's bf16 autocast off)
            loss = sequence_loss(out, targets).loss
        else:
            loss = logits_loss(out.logits if isinstance(out, ModelOutput) else out, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def step_flops(step) -> int:
    """The model FLOPs of one step (``torch.utils.flop_counter``), of a plain model's step: the counter
    has no formula for CPU attention kernels, so attention is counted for no peer."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def aiayn_row(name: str, build, args: argparse.Namespace, drop: Dropouts, size) -> nn.Module:
    """A fresh aiayn model for row ``name`` (the same seed: the same weights in every row), through
    ``optimize(model, "train")`` unless it is the plain-torch row; the compiled row compiled."""
    torch.manual_seed(args.seed)
    model = build(size, drop).train()
    if name != PLAIN:
        optimize_aiayn(model, "train")
    return torch.compile(model) if name == COMPILED else model


def workload(args: argparse.Namespace):
    """The suite's (size, peers, forward(name) -> call of a model on the batch, targets, tokens
    per step, title)."""
    gen = torch.Generator().manual_seed(args.seed)
    if args.suite == "decoder":
        size = LMSize()
        batch, length = (16, 256) if not args.quick else (8, 128)
        data = torch.randint(0, size.vocab, (batch, length + 1), generator=gen)
        inputs = data[:, :-1]

        def forward(name: str):
            return (lambda m: m(inputs)) if name in AIAYN_ROWS else (lambda m: lm_logits(name, m, inputs))

        title = (f"Training step, decoder-only (d {size.d_model}, {size.n_layers} layers, {size.n_heads} heads, "
                 f"d_ff {size.d_ff}, vocab {size.vocab:,}), batch {batch} x {length}")
        return size, LM_TRAIN_PEERS, forward, data[:, 1:], batch * length, title
    size = SEQ2SEQ_SIZES[args.suite]
    src, src_valid = padded_batch(size.batch, size.src_len, size.vocab, gen)
    tgt, tgt_valid = padded_batch(size.batch, size.tgt_len + 1, size.vocab, gen)
    tgt_valid[:, 0] = True  # BOS
    title = (f"Training step, encoder-decoder `{size.name}` (d {size.d_model}, {size.n_heads} heads, "
             f"{size.n_layers}+{size.n_layers} layers, d_ff {size.d_ff}, vocab {size.vocab:,}), "
             f"batch {size.batch} x ({size.src_len} + {size.tgt_len}) tokens, padded")
    return (size, SEQ2SEQ_PEERS, lambda name: lambda m: m(src, tgt[:, :-1], src_valid, tgt_valid[:, :-1]),
            tgt[:, 1:].masked_fill(~tgt_valid[:, 1:], -100), size.batch * (size.src_len + size.tgt_len), title)


def run_suite(args: argparse.Namespace, drop: Dropouts) -> dict[str, float]:
    """Time every peer of ``args.suite`` (a missing library's peer is a row naming its extra)."""
    size, builders, forward, targets, tokens, title = workload(args)
    aiayn_build = builders["aiayn"]
    peers, params = [], {}

    def add(name: str, build) -> None:
        if name in AIAYN_ROWS:
            model = aiayn_row(name, build, args, drop, size)
        else:
            torch.manual_seed(args.seed)
            model = common.load_peer(name, lambda: build(size, drop).train())
        if model is not None:
            params[name] = common.count_params(model)
            peers.append(common.Timed(name, make_step(model, forward(name), targets, sequence=name in SEQUENCE_LOSS_ROWS)))

    for name in args.peers or builders:
        add(name, builders[name])
        if name == "aiayn" and not args.no_compiled:  # a second, identical model, torch.compile'd
            add(COMPILED, aiayn_build)
        if name == "aiayn" and not args.no_plain:  # a third, without aiayn.fast
            add(PLAIN, aiayn_build)
    common.mark_start(args)

    def twin_flops(build, *, sequence: bool) -> int:  # counted on a plain twin of an aiayn model
        torch.manual_seed(args.seed)
        return step_flops(make_step(build(size, drop).train(), forward("aiayn"), targets, sequence=sequence))

    # Every peer computes the padded model's FLOPs; padding-free aiayn's rows skip the padding's share.
    decoder = args.suite == "decoder"
    flops = dict.fromkeys(params, twin_flops(aiayn_build if decoder else aiayn_padded_seq2seq, sequence=decoder))
    if not decoder and "aiayn" in flops:
        own = twin_flops(aiayn_seq2seq, sequence=True)
        flops.update({name: own for name in SEQUENCE_LOSS_ROWS if name in flops})
    peaks = common.matmul_peaks(repeats=args.repeats + 2)
    common.measure(peers, args)
    after = common.matmul_peaks(repeats=args.repeats + 2)  # before and after; the better one of each
    peaks = {backend: max(rate, after[backend]) for backend, rate in peaks.items()}
    report(title, peers, params, tokens, flops, peaks, args)
    return {p.name: tokens / p.median for p in peers}


def report(title: str, peers: list[common.Timed], params: dict[str, int], tokens: int, flops: dict[str, int],
           peaks: dict[str, float], args: argparse.Namespace) -> None:
    """The table and ratio lines; MFU is each peer's FLOPs per step against both measured 2048^3 rates
    (``torch.mm``, and oneDNN, the faster product aiayn's linear layers run at: the stricter one)."""
    common.header(title, args)
    rows = []
    for p in peers:
        achieved = flops[p.name] / p.median
        rows.append([p.name, common.fmt_int(params[p.name]), f"{p.median * 1e3:.1f}", f"±{p.spread * 50:.0f}%",
                     common.fmt_int(tokens / p.median), f"{achieved / 1e9:.1f}", f"{achieved / peaks['torch.mm']:.2f}",
                     f"{achieved / peaks['onednn']:.2f}" if peaks["onednn"] else "-"])
    print(common.table(["peer", "parameters", "ms / step (median)", "spread", "tokens/s", "model GFLOP/s",
                 "MFU (torch.mm peak)", "MFU (oneDNN peak)"], rows))
    counts = sorted(set(flops.values()), reverse=True)
    counted = " / ".join(f"{f / 1e9:.2f} GFLOP ({', '.join(n for n in flops if flops[n] == f)})" for f in counts)
    print(f"\nmodel FLOPs per step (fwd + bwd, counted on plain aiayn by torch.utils.flop_counter): {counted}; "
          f"matmul peak (fp32 2048^3, measured): torch.mm {peaks['torch.mm'] / 1e9:.1f}, "
          f"oneDNN {peaks['onednn'] / 1e9:.1f} GFLOP/s\n")
    others = {p.name: tokens / p.median for p in peers if not p.name.startswith("aiayn")}
    for p in peers:
        if p.name.startswith("aiayn"):
            print("* " + common.ratio_line(f"training tokens/s, {p.name}", tokens / p.median, others,
                                    target=TRAINING_TARGET))
    if args.suite == "paper-base":
        for p in peers:
            if p.name.startswith("aiayn"):
                mfu = flops[p.name] / p.median / peaks["torch.mm"]
                verdict = "met" if mfu >= MFU_TARGET else f"MISSED by {MFU_TARGET / mfu:.2f}x"
                strict = (f"; {flops[p.name] / p.median / peaks['onednn']:.2f} of the oneDNN peak"
                          if peaks["onednn"] else "")
                print(f"* {p.name} MFU {mfu:.2f} of the measured torch.mm peak (target >= {MFU_TARGET}: "
                      f"{verdict}){strict}")
    common.footer()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["small", "paper-base", "decoder", "all"], default="all")
    parser.add_argument("--peers", nargs="*", help="subset of peers (aiayn first)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="residual/embedding, attention and activation dropout of every peer (default 0)")
    parser.add_argument("--no-plain", action="store_true",
                        help=f"skip the '{PLAIN}' row (the same model without aiayn.fast.optimize: "
                             "MKL matmuls, SDPA attention, logits then the loss; aiayn train --plain)")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip the 'aiayn compiled' row (torch.compile of the same optimized model, as "
                             "`aiayn train --compile` does; compiling takes a minute or more)")
    common.add_common_args(parser, repeats=7, warmup=3)
    args = parser.parse_args(argv)
    common.setup(args)
    quiet()
    drop = Dropouts(args.dropout, args.dropout, args.dropout)
    suites = ["small", "paper-base", "decoder"] if args.suite == "all" else [args.suite]
    for suite in suites:
        args.suite = suite
        run_suite(args, drop)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
