"""Training throughput: forward + backward + Adam step, tokens/s, aiayn against its peers.

Benchmark 1 (encoder-decoder, ``--suite small`` / ``paper-base``): aiayn, torch.nn.Transformer
(same embeddings and tied head), Hugging Face BART and x-transformers' XTransformer, batch
32 x (32 source + 32 target) tokens with random right padding (lengths 16..32), plus model FLOPs
utilisation against the fp32 2048 x 2048 ``torch.mm`` peak measured in the same run (and against
the same product through oneDNN, which runs at about twice ``torch.mm``'s MKL rate on this AMD
CPU and which aiayn's linear layers use: ``aiayn.fast.onednn``). "aiayn" is
the model with ``ModelConfig.padding_free`` on (``aiayn train --padding-free``: token-wise layers
on the real tokens only) and, as every aiayn training task runs it, given the targets: its output
layer fused with the cross-entropy (``aiayn.fast.fused_loss``, no logits made).
"aiayn padded" is the same model computing its padding and its logits for the shared
``F.cross_entropy``: what the other peers compute. "aiayn plain torch" is "aiayn" with its CPU
kernels turned off (``aiayn.fast.switch.plain_torch``: ``F.linear``/MKL matmuls and SDPA
attention, as the peers call): the difference between the two rows is those kernels.
Benchmark 2 (``--suite decoder``): decoder-only, d 256, 4 layers, 4 heads, vocab 8,000, batch
16 x 256, against Hugging Face GPT-2 and x-transformers' ``TransformerWrapper(Decoder)``. "aiayn"
fuses its output layer with the loss as above; "aiayn logits" is the same model making its
(b, t, v) logits for the shared ``F.cross_entropy``, as the other peers do.

Same loss (token cross-entropy, padding ignored: ``F.cross_entropy`` over each peer's logits,
or aiayn's fused equal of it, ``tests/consistency/test_fused_loss.py``), same optimiser (torch
Adam, lr 1e-4, betas (0.9, 0.98), eps 1e-9, its fused kernel unless ``--adam for-loop``), same
dropout (``--dropout``, default 0: every dropout of every peer off), same batch, same process.
aiayn runs eager and, as "aiayn compiled", under ``torch.compile`` (what ``aiayn train
--compile`` does; the warm-up steps compile, untimed; the fused loss stays eager); the peers run
eager, their default.
tokens/s counts every position fed to the model, padding included (batch x (source + target)
for encoder-decoder, batch x length for decoder-only).
Model FLOPs are counted on aiayn's steps with ``torch.utils.flop_counter`` run on plain torch
ops (forward + backward matmuls; the counter has no formula for torch's CPU attention kernels, so
attention, a few per cent of these steps, is not counted for any peer): the padded step's count
for every peer, padding-free aiayn's own (smaller) count for its rows; MFU = the row's FLOPs per
step / step time / measured matmul peak (both peaks, two columns).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from aiayn.fast import switch as fastpath
from aiayn.train.losses import loss_logits, sequence_loss
from benchmarks.common import (
    Timed,
    add_common_args,
    count_params,
    fmt_int,
    footer,
    header,
    mark_start,
    matmul_peaks,
    ratio_line,
    run_interleaved,
    setup,
    table,
    top_ops,
)
from benchmarks.peers import (
    LM_PEERS,
    SEQ2SEQ_PEERS,
    SEQ2SEQ_SIZES,
    Dropouts,
    LMSize,
    aiayn_padded_seq2seq,
    lm_logits,
    quiet,
)

TRAINING_TARGET = 1.2
COMPILED = "aiayn compiled"  # the aiayn model under torch.compile (aiayn train --compile)
UNFUSED = "aiayn logits"  # the aiayn decoder making its logits for the shared F.cross_entropy
PLAIN = "aiayn plain torch"  # aiayn's step with its CPU kernels off (aiayn.fast.switch): MKL, SDPA

# Decoder-only training peers: aiayn (output layer fused with its loss), the same model through
# logits + F.cross_entropy, and the others.
LM_TRAIN_PEERS = {"aiayn": LM_PEERS["aiayn"], UNFUSED: LM_PEERS["aiayn"],
                  **{name: build for name, build in LM_PEERS.items() if name != "aiayn"}}
MFU_TARGET = 0.6


def plain_torch(step):
    """The same step with aiayn's CPU kernels (oneDNN linears, block-causal attention) turned off."""
    def run() -> None:
        with fastpath.plain_torch():
            step()
    return run


FUSED_ADAM = True  # set from --adam


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The same Adam for every peer: torch's fused kernel (``--adam fused``) or its for-loop one."""
    return torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                            fused=FUSED_ADAM or None)


def padded_batch(batch: int, length: int, vocab: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random ids in [3, vocab) right-padded with 0 to ``length``; lengths in [length/2, length]."""
    tokens = torch.randint(3, vocab, (batch, length), generator=gen)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    lengths[0] = length  # the longest row fills the batch
    valid = torch.arange(length)[None, :] < lengths[:, None]
    return tokens.masked_fill(~valid, 0), valid


def seq2seq_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Tensor], *, fused: bool = False):
    """One training step; ``fused``: the model (aiayn) is given the targets and runs its output
    layer fused with the loss, ``sequence_loss`` on its ``HeadLoss`` (as ``aiayn train``)."""
    targets, packed_targets = batch["tgt_out"].reshape(-1), batch["tgt_out"][batch["tgt_valid"]]

    def step() -> None:
        if fused:
            head = model(batch["src"], batch["tgt_in"], batch["src_valid"], batch["tgt_valid"], batch["tgt_out"])
            loss = sequence_loss(head, batch["tgt_out"]).loss
        else:
            logits = model(batch["src"], batch["tgt_in"], batch["src_valid"], batch["tgt_valid"])
            # (b, t, v), or (n, v) for the real target positions from a peer that skips padding
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   targets if logits.dim() == 3 else packed_targets, ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def lm_step(name: str, model: nn.Module, opt: torch.optim.Optimizer, tokens: Tensor, *, fused: bool = False):
    """One training step; ``fused`` as in ``seq2seq_step``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        if fused:
            loss = sequence_loss(loss_logits(model(inputs, targets=targets)), targets).loss
        else:
            logits = lm_logits(name, model, inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def step_flops(step) -> int:
    """The model FLOPs of one step, counted with plain torch ops (``fastpath.plain_torch``): the
    flop counter has no formula for torch's CPU attention kernels, so attention is not counted,
    for any peer, and aiayn's own kernels must not add theirs."""
    with fastpath.plain_torch(), FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def run_seq2seq(args: argparse.Namespace, drop: Dropouts) -> dict[str, float]:
    size = SEQ2SEQ_SIZES[args.suite]
    gen = torch.Generator().manual_seed(args.seed)
    src, src_valid = padded_batch(size.batch, size.src_len, size.vocab, gen)
    tgt, tgt_valid = padded_batch(size.batch, size.tgt_len + 1, size.vocab, gen)
    tgt_valid[:, 0] = True  # BOS
    batch = {"src": src, "src_valid": src_valid, "tgt_in": tgt[:, :-1], "tgt_valid": tgt_valid[:, :-1],
             "tgt_out": tgt[:, 1:].masked_fill(~tgt_valid[:, 1:], -100)}
    tokens = size.batch * (size.src_len + size.tgt_len)
    peers, params, models = [], {}, {}
    for name in args.peers or SEQ2SEQ_PEERS:
        torch.manual_seed(args.seed)
        model = SEQ2SEQ_PEERS[name](size, drop).train()
        models[name], params[name] = model, count_params(model)
        fused = name == "aiayn"
        peers.append(Timed(name, seq2seq_step(model, make_optimizer(model), batch, fused=fused)))
        if fused and not args.no_compiled:  # a second, identical model, torch.compile'd
            torch.manual_seed(args.seed)
            twin = SEQ2SEQ_PEERS[name](size, drop).train()
            params[COMPILED] = count_params(twin)
            peers.append(Timed(COMPILED, seq2seq_step(torch.compile(twin), make_optimizer(twin), batch,
                                                      fused=True)))
        if fused and not args.no_plain:
            torch.manual_seed(args.seed)
            twin = SEQ2SEQ_PEERS[name](size, drop).train()
            params[PLAIN] = count_params(twin)
            peers.append(Timed(PLAIN, plain_torch(seq2seq_step(twin, make_optimizer(twin), batch, fused=True))))
    mark_start(args)
    # FLOPs each peer computes per step: the padded computation for every peer but padding-free
    # aiayn (and its compiled and plain-torch twins), which skip the padding's share; counted on
    # aiayn's steps.
    padded_step = next((p.fn for p in peers if p.name == "aiayn padded"), None)
    if padded_step is None:
        twin = aiayn_padded_seq2seq(size, drop).train()
        padded_step = seq2seq_step(twin, make_optimizer(twin), batch)
    padded = step_flops(padded_step)
    flops = {p.name: padded for p in peers}
    if "aiayn" in models:
        own = step_flops(next(p.fn for p in peers if p.name == "aiayn"))
        flops.update({name: own for name in ("aiayn", COMPILED, PLAIN) if name in flops})
    peaks = matmul_peaks(repeats=args.repeats + 2)
    run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
    after = matmul_peaks(repeats=args.repeats + 2)  # before and after; the better one of each
    peaks = {backend: max(rate, after[backend]) for backend, rate in peaks.items()}

    title = (f"Training step, encoder-decoder `{size.name}` (d {size.d_model}, {size.n_heads} heads, "
             f"{size.n_layers}+{size.n_layers} layers, d_ff {size.d_ff}, vocab {size.vocab:,}), "
             f"batch {size.batch} x ({size.src_len} + {size.tgt_len}) tokens, padded")
    report(title, peers, params, tokens, flops, peaks, args)
    if args.profile:
        print(f"\ntorch.profiler, aiayn, {args.suite}, top ops by self CPU time (3 steps):\n")
        print("```\n" + top_ops(peers[0].fn) + "\n```")
    return {p.name: tokens / p.median for p in peers}


def run_decoder(args: argparse.Namespace, drop: Dropouts) -> dict[str, float]:
    size = LMSize()
    batch, length = (16, 256) if not args.quick else (8, 128)
    gen = torch.Generator().manual_seed(args.seed)
    tokens_in = torch.randint(0, size.vocab, (batch, length + 1), generator=gen)
    tokens = batch * length
    peers, params = [], {}
    for name in args.peers or LM_TRAIN_PEERS:
        torch.manual_seed(args.seed)
        model = LM_TRAIN_PEERS[name](size, drop).train()
        params[name] = count_params(model)
        fused = name == "aiayn"
        peers.append(Timed(name, lm_step(name, model, make_optimizer(model), tokens_in, fused=fused)))
        if fused and not args.no_compiled:
            torch.manual_seed(args.seed)
            twin = LM_TRAIN_PEERS[name](size, drop).train()
            params[COMPILED] = count_params(twin)
            peers.append(Timed(COMPILED, lm_step(name, torch.compile(twin), make_optimizer(twin), tokens_in,
                                                 fused=True)))
        if fused and not args.no_plain:
            torch.manual_seed(args.seed)
            twin = LM_TRAIN_PEERS[name](size, drop).train()
            params[PLAIN] = count_params(twin)
            peers.append(Timed(PLAIN, plain_torch(lm_step(name, twin, make_optimizer(twin), tokens_in, fused=True))))
    mark_start(args)
    counted = step_flops(peers[0].fn)  # no padding here: every peer computes the same FLOPs
    flops = {p.name: counted for p in peers}
    peaks = matmul_peaks(repeats=args.repeats + 2)
    run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
    after = matmul_peaks(repeats=args.repeats + 2)
    peaks = {backend: max(rate, after[backend]) for backend, rate in peaks.items()}
    title = (f"Training step, decoder-only (d {size.d_model}, {size.n_layers} layers, {size.n_heads} heads, "
             f"d_ff {size.d_ff}, vocab {size.vocab:,}), batch {batch} x {length}")
    report(title, peers, params, tokens, flops, peaks, args)
    if args.profile:
        print("\ntorch.profiler, aiayn, decoder-only, top ops by self CPU time (3 steps):\n")
        print("```\n" + top_ops(peers[0].fn) + "\n```")
    return {p.name: tokens / p.median for p in peers}


def report(title: str, peers: list[Timed], params: dict[str, int], tokens: int, flops: dict[str, int],
           peaks: dict[str, float], args: argparse.Namespace) -> None:
    """``flops``: the FLOPs each peer computes per step (its own arithmetic: MFU is of that).
    ``peaks``: the measured 2048^3 rates. MFU is given against both: the ``torch.mm`` rate (the
    issue's definition, MKL here) and the oneDNN rate (the faster product this torch build has,
    which aiayn's linear layers run at, so the stricter measure of how much of the machine is used)."""
    header(title, args)
    rows = []
    for p in peers:
        achieved = flops[p.name] / p.median
        rows.append([p.name, fmt_int(params[p.name]), f"{p.median * 1e3:.1f}", f"±{p.spread * 50:.0f}%",
                     fmt_int(tokens / p.median), f"{achieved / 1e9:.1f}", f"{achieved / peaks['torch.mm']:.2f}",
                     f"{achieved / peaks['onednn']:.2f}" if peaks["onednn"] else "-"])
    print(table(["peer", "parameters", "ms / step (median)", "spread", "tokens/s", "model GFLOP/s",
                 "MFU (torch.mm peak)", "MFU (oneDNN peak)"], rows))
    counts = sorted(set(flops.values()), reverse=True)
    counted = " / ".join(f"{f / 1e9:.2f} GFLOP ({', '.join(n for n in flops if flops[n] == f)})" for f in counts)
    print(f"\nmodel FLOPs per step (fwd + bwd, counted on aiayn by torch.utils.flop_counter): {counted}; "
          f"matmul peak (fp32 2048^3, measured): torch.mm {peaks['torch.mm'] / 1e9:.1f}, "
          f"oneDNN {peaks['onednn'] / 1e9:.1f} GFLOP/s\n")
    others = {p.name: tokens / p.median for p in peers if not p.name.startswith("aiayn")}
    for p in peers:
        if p.name.startswith("aiayn"):
            print("* " + ratio_line(f"training tokens/s, {p.name}", tokens / p.median, others,
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
    footer()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["small", "paper-base", "decoder", "all"], default="all")
    parser.add_argument("--peers", nargs="*", help="subset of peers (aiayn first)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="residual/embedding, attention and activation dropout of every peer (default 0)")
    parser.add_argument("--profile", action="store_true", help="also print aiayn's top ops (torch.profiler)")
    parser.add_argument("--adam", choices=["fused", "for-loop"], default="fused",
                        help="torch Adam implementation, the same for every peer (default fused: "
                             "torch's fastest on CPU)")
    parser.add_argument("--no-plain", action="store_true",
                        help=f"skip the '{PLAIN}' row (aiayn's step with its CPU kernels off: "
                             "MKL matmuls, SDPA attention; AIAYN_PLAIN_TORCH=1)")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip the 'aiayn compiled' row (torch.compile of the same model, as "
                             "`aiayn train --compile` does; compiling takes a minute or more)")
    add_common_args(parser, repeats=7, warmup=3)
    args = parser.parse_args(argv)
    setup(args)
    global FUSED_ADAM
    FUSED_ADAM = args.adam == "fused"
    quiet()
    drop = Dropouts(args.dropout, args.dropout, args.dropout)
    suites = ["small", "paper-base", "decoder"] if args.suite == "all" else [args.suite]
    for suite in suites:
        args.suite = suite
        (run_decoder if suite == "decoder" else run_seq2seq)(args, drop)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
