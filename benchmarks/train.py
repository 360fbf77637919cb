"""Training throughput: forward + backward + Adam step, tokens/s, aiayn against its peers.

Benchmark 1 (encoder-decoder, ``--suite small`` / ``paper-base``): aiayn, torch.nn.Transformer
(same embeddings and tied head), Hugging Face BART and x-transformers' XTransformer, batch
32 x (32 source + 32 target) tokens with random right padding (lengths 16..32), plus model FLOPs
utilisation against the fp32 2048 x 2048 ``torch.mm`` peak measured in the same run (and against
the same product through oneDNN, which runs at about twice ``torch.mm``'s MKL rate on this AMD
CPU and which aiayn's linear layers use: ``aiayn.fast.onednn``). Every aiayn row but "aiayn
plain torch" is the model after ``aiayn.fast.optimize(model, "train")``, as ``aiayn train``
trains it (its CPU kernels: oneDNN linear layers, block-causal attention, the faster dropout, the
output layer fused with the loss). "aiayn" is the model with ``ModelConfig.padding_free`` on
(``aiayn train --padding-free``: token-wise layers on the real tokens only), its step ``aiayn
train``'s: ``out = model(...)``, ``sequence_loss(out, targets)``, which runs the output layer
fused with the cross-entropy over the real tokens (``aiayn.fast.fused_loss``, no logits made).
"aiayn padded" is the same optimized model computing its padding and its (b, t, v) logits
(``ModelOutput.logits``) for the shared ``F.cross_entropy``: what the other peers compute.
"aiayn plain torch" is "aiayn" without ``optimize``: the plain PyTorch model (``nn.Linear``/MKL
matmuls, SDPA attention, as the peers call; ``aiayn train --plain``), its step the same
``sequence_loss(out, targets)``, which then makes logits of the real tokens only and takes their
cross-entropy (no fused loss): the difference between the two rows is ``aiayn.fast``.
Benchmark 2 (``--suite decoder``): decoder-only, d 256, 4 layers, 4 heads, vocab 8,000, batch
16 x 256, against Hugging Face GPT-2 and x-transformers' ``TransformerWrapper(Decoder)``. "aiayn"
and "aiayn plain torch" as above; "aiayn logits" is the optimized model making its (b, t, v)
logits for the shared ``F.cross_entropy``, as the other peers do (its CPU kernels, no fused loss).

Same loss (token cross-entropy, padding ignored: ``F.cross_entropy`` over each peer's logits,
or aiayn's ``sequence_loss``, equal to it, ``tests/parity/test_losses_vs_torch.py`` and
``tests/consistency/test_fused_loss.py``), same optimiser (torch Adam, lr 1e-4, betas (0.9, 0.98),
eps 1e-9, its fused kernel unless ``--adam for-loop``), same dropout (``--dropout``, default 0:
every dropout of every peer off), same batch, same process. aiayn's forward and loss run under
the trainer's autocast context (``aiayn train``'s ``bf16`` off: float32, as every peer).
aiayn runs eager and, as "aiayn compiled", under ``torch.compile`` (the optimized model, as
``aiayn train --compile`` compiles it; the warm-up steps compile, untimed; the fused loss stays
eager); the peers run eager, their default.
tokens/s counts every position fed to the model, padding included (batch x (source + target)
for encoder-decoder, batch x length for decoder-only).
Model FLOPs are counted with ``torch.utils.flop_counter`` on a step of the plain (not optimized)
aiayn model, a twin of the timed ones (forward + backward matmuls; the counter has no formula for
torch's CPU attention kernels, so attention, a few per cent of these steps, is not counted for
any peer): the padded model's count for every peer, padding-free aiayn's own (smaller) count for
its rows; MFU = the row's FLOPs per step / step time / measured matmul peak (both peaks, two
columns).
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

# Decoder-only training peers: aiayn (output layer fused with its loss), the same model through
# logits + F.cross_entropy, and the others.
LM_TRAIN_PEERS = {"aiayn": LM_PEERS["aiayn"], UNFUSED: LM_PEERS["aiayn"],
                  **{name: build for name, build in LM_PEERS.items() if name != "aiayn"}}
# Rows of aiayn models, built plain, then optimize(model, "train") for every one but PLAIN; those
# of SEQUENCE_LOSS_ROWS take aiayn train's loss (sequence_loss on the model's output), the others
# the peers' F.cross_entropy on the model's logits.
AIAYN_ROWS = ("aiayn", COMPILED, PLAIN, PADDED, UNFUSED)
SEQUENCE_LOSS_ROWS = ("aiayn", COMPILED, PLAIN)
MFU_TARGET = 0.6
BF16 = False  # aiayn train's autocast setting (TrainConfig.bf16) for the aiayn rows: off, float32 as every peer


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


def aiayn_loss(out: ModelOutput, targets: Tensor) -> Tensor:
    """``aiayn train``'s loss of a forward: ``sequence_loss`` on the model's output (fused with the
    output layer when ``optimize(model, "train")`` gave it one; over the real tokens only when
    the model is padding-free)."""
    return sequence_loss(out, targets).loss


def logits_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The peers' loss: ``F.cross_entropy`` over (b, t, v) logits, padding (-100) ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def seq2seq_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Tensor], *,
                 sequence: bool = False):
    """One training step; ``sequence``: an aiayn model's step as ``aiayn train`` runs it
    (``out = model(...)``, ``sequence_loss(out, targets)`` under the trainer's autocast context);
    otherwise the peers' step (logits, ``F.cross_entropy``; an aiayn model's through
    ``ModelOutput.logits``)."""
    targets = batch["tgt_out"]  # (b, t), -100 at padding

    def step() -> None:
        if sequence:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16):
                out = model(batch["src"], batch["tgt_in"], batch["src_valid"], batch["tgt_valid"])
                loss = aiayn_loss(out, targets)
        else:
            out = model(batch["src"], batch["tgt_in"], batch["src_valid"], batch["tgt_valid"])
            loss = logits_loss(out.logits if isinstance(out, ModelOutput) else out, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def lm_step(name: str, model: nn.Module, opt: torch.optim.Optimizer, tokens: Tensor, *, sequence: bool = False):
    """One training step; ``sequence`` as in ``seq2seq_step``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        if sequence:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16):
                loss = aiayn_loss(model(inputs), targets)
        else:
            loss = logits_loss(lm_logits(name, model, inputs), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def step_flops(step) -> int:
    """The model FLOPs of one step, counted by ``torch.utils.flop_counter``. Give it a step of the
    plain (not optimized) model: the counter has no formula for torch's CPU attention kernels, so
    attention is not counted, for any peer, and aiayn's own kernels must not add theirs."""
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


def run_seq2seq(args: argparse.Namespace, drop: Dropouts) -> dict[str, float]:
    size = SEQ2SEQ_SIZES[args.suite]
    gen = torch.Generator().manual_seed(args.seed)
    src, src_valid = padded_batch(size.batch, size.src_len, size.vocab, gen)
    tgt, tgt_valid = padded_batch(size.batch, size.tgt_len + 1, size.vocab, gen)
    tgt_valid[:, 0] = True  # BOS
    batch = {"src": src, "src_valid": src_valid, "tgt_in": tgt[:, :-1], "tgt_valid": tgt_valid[:, :-1],
             "tgt_out": tgt[:, 1:].masked_fill(~tgt_valid[:, 1:], -100)}
    tokens = size.batch * (size.src_len + size.tgt_len)
    peers, params = [], {}

    def add(name: str, build, *, sequence: bool) -> None:
        if name in AIAYN_ROWS:
            model = aiayn_row(name, build, args, drop, size)
        else:
            torch.manual_seed(args.seed)
            model = build(size, drop).train()
        params[name] = count_params(model)
        peers.append(Timed(name, seq2seq_step(model, make_optimizer(model), batch, sequence=sequence)))

    for name in args.peers or SEQ2SEQ_PEERS:
        add(name, SEQ2SEQ_PEERS[name], sequence=name == "aiayn")
        if name == "aiayn" and not args.no_compiled:  # a second, identical model, torch.compile'd
            add(COMPILED, aiayn_seq2seq, sequence=True)
        if name == "aiayn" and not args.no_plain:  # a third, without aiayn.fast
            add(PLAIN, aiayn_seq2seq, sequence=True)
    mark_start(args)
    # FLOPs each peer computes per step, counted on plain twins of aiayn's models: the padded
    # model's step (logits of every position, F.cross_entropy) for every peer but padding-free
    # aiayn (and its compiled and plain-torch twins), which skip the padding's share.

    def plain_flops(build, *, sequence: bool) -> int:
        torch.manual_seed(args.seed)
        twin = build(size, drop).train()
        return step_flops(seq2seq_step(twin, make_optimizer(twin), batch, sequence=sequence))

    padded = plain_flops(aiayn_padded_seq2seq, sequence=False)
    flops = {p.name: padded for p in peers}
    if "aiayn" in flops:
        own = plain_flops(aiayn_seq2seq, sequence=True)
        flops.update({name: own for name in SEQUENCE_LOSS_ROWS if name in flops})
    peaks = matmul_peaks(repeats=args.repeats + 2)
    run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
    after = matmul_peaks(repeats=args.repeats + 2)  # before and after; the better one of each
    peaks = {backend: max(rate, after[backend]) for backend, rate in peaks.items()}

    title = (f"Training step, encoder-decoder `{size.name}` (d {size.d_model}, {size.n_heads} heads, "
             f"{size.n_layers}+{size.n_layers} layers, d_ff {size.d_ff}, vocab {size.vocab:,}), "
             f"batch {size.batch} x ({size.src_len} + {size.tgt_len}) tokens, padded")
    report(title, peers, params, tokens, flops, peaks, args)
    if args.profile:
        print(f"\ntorch.profiler, {peers[0].name}, {args.suite}, top ops by self CPU time (3 steps):\n")
        print("```\n" + top_ops(peers[0].fn) + "\n```")
    return {p.name: tokens / p.median for p in peers}


def run_decoder(args: argparse.Namespace, drop: Dropouts) -> dict[str, float]:
    size = LMSize()
    batch, length = (16, 256) if not args.quick else (8, 128)
    gen = torch.Generator().manual_seed(args.seed)
    tokens_in = torch.randint(0, size.vocab, (batch, length + 1), generator=gen)
    tokens = batch * length
    peers, params = [], {}

    def add(name: str, build, *, sequence: bool) -> None:
        if name in AIAYN_ROWS:
            model = aiayn_row(name, build, args, drop, size)
        else:
            torch.manual_seed(args.seed)
            model = build(size, drop).train()
        params[name] = count_params(model)
        peers.append(Timed(name, lm_step(name, model, make_optimizer(model), tokens_in, sequence=sequence)))

    for name in args.peers or LM_TRAIN_PEERS:
        add(name, LM_TRAIN_PEERS[name], sequence=name == "aiayn")
        if name == "aiayn" and not args.no_compiled:
            add(COMPILED, LM_PEERS["aiayn"], sequence=True)
        if name == "aiayn" and not args.no_plain:
            add(PLAIN, LM_PEERS["aiayn"], sequence=True)
    mark_start(args)
    # No padding here: every peer computes the same FLOPs, counted on a plain twin of aiayn's model.
    torch.manual_seed(args.seed)
    twin = LM_PEERS["aiayn"](size, drop).train()
    counted = step_flops(lm_step("aiayn", twin, make_optimizer(twin), tokens_in, sequence=True))
    del twin
    flops = {p.name: counted for p in peers}
    peaks = matmul_peaks(repeats=args.repeats + 2)
    run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
    after = matmul_peaks(repeats=args.repeats + 2)
    peaks = {backend: max(rate, after[backend]) for backend, rate in peaks.items()}
    title = (f"Training step, decoder-only (d {size.d_model}, {size.n_layers} layers, {size.n_heads} heads, "
             f"d_ff {size.d_ff}, vocab {size.vocab:,}), batch {batch} x {length}")
    report(title, peers, params, tokens, flops, peaks, args)
    if args.profile:
        print(f"\ntorch.profiler, {peers[0].name}, decoder-only, top ops by self CPU time (3 steps):\n")
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
    print(f"\nmodel FLOPs per step (fwd + bwd, counted on plain aiayn by torch.utils.flop_counter): {counted}; "
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
                        help=f"skip the '{PLAIN}' row (the same model without aiayn.fast.optimize: "
                             "MKL matmuls, SDPA attention, logits then the loss; aiayn train --plain)")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip the 'aiayn compiled' row (torch.compile of the same optimized model, as "
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
