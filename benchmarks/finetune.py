"""Fine-tuning SmolLM2-135M-Instruct: aiayn against transformers + PEFT, tokens/s and peak memory.

Rows: LoRA (rank ``--rank``, alpha 2 x rank, on q, k, v, o, gate, up, down) and full fine-tuning,
each library's own way (aiayn as ``aiayn train --init-from`` runs it; transformers'
``AutoModelForCausalLM`` of the same GGUF, PEFT for LoRA), on the same batch of Tiny Shakespeare
with the same AdamW settings, float32. Each row runs in its own process, interleaved over
``--repeats`` rounds; peak memory is the peak resident set over the timed steps."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from aiayn.config import TrainConfig
from aiayn.train.optim import make_optimizer
from benchmarks import common
from benchmarks.llama_cpp import peak_rss_mib

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS = ("aiayn LoRA", "PEFT LoRA", "aiayn full", "transformers full")
PEERS = {"aiayn LoRA": "PEFT LoRA", "aiayn full": "transformers full"}
GOALS = {"aiayn LoRA": (1.5, 0.8)}  # (tokens/s at least, peak memory at most) times the peer's


def batch_of(args: argparse.Namespace, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token targets), ``--batch`` fixed windows of ``--seq-len`` tokens; each window's
    last target is ignored, as transformers' shifted loss has none: both average the same predictions."""
    from aiayn.data import dataset_file
    from aiayn.train.losses import IGNORE

    text = dataset_file("tinyshakespeare", "input.txt").read_text(encoding="utf-8")[:200_000]
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)
    starts = torch.randint(0, len(ids) - args.seq_len - 1, (args.batch,), generator=torch.Generator().manual_seed(0))
    windows = torch.stack([ids[s:s + args.seq_len + 1] for s in starts.tolist()])
    targets = windows[:, 1:].clone()
    targets[:, -1] = IGNORE
    return windows[:, :-1], targets


def aiayn_step(lora: bool, args: argparse.Namespace):
    """A training step of aiayn's model, as ``aiayn train --init-from`` takes it."""
    from aiayn.fast import optimize
    from aiayn.finetune.lora import LoraConfig, apply_lora
    from aiayn.tasks.sources import load_source
    from aiayn.train.losses import sequence_loss

    source = load_source(common.smollm2(), echo=lambda _: None)
    model = source.model
    if lora:
        apply_lora(model, LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=TARGETS))
    optimize(model, mode="train")
    inputs, targets = batch_of(args, source.text.tokenizer)

    def loss() -> torch.Tensor:
        return sequence_loss(model(inputs), targets).loss
    return model, loss


def hf_step(lora: bool, args: argparse.Namespace):
    """A training step of transformers' model (with PEFT's adapters for LoRA)."""
    from aiayn.textgen import read_text_model

    model = common.hf_causal_lm(common.smollm2()).train()
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                           target_modules=HF_TARGETS))
    inputs, _ = batch_of(args, read_text_model(common.smollm2()).tokenizer)

    def loss() -> torch.Tensor:  # (labels = inputs: transformers shifts them itself)
        return model(input_ids=inputs, labels=inputs, use_cache=False).loss
    return model, loss


def child(row: str, args: argparse.Namespace) -> dict[str, float]:
    """One round of ``row`` in this process: tokens/s of the timed steps and their peak memory."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, loss = (aiayn_step if row.startswith("aiayn") else hf_step)("LoRA" in row, args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if row.startswith("aiayn"):
        optimizer = make_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                                      weight_decay=0.01, decay_all=True))
    else:
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        optimizer.step()
        return float(value)

    first = [step() for _ in range(args.warmup)]
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    seconds = sum(common.timings(step, args.steps)[0])
    return {"tokens_per_s": args.steps * args.batch * args.seq_len / seconds, "peak_mib": peak_rss_mib(),
            "trainable": sum(p.numel() for p in trainable), "first_loss": first[0] if first else float("nan")}


def run_round(row: str, argv: list[str]) -> dict[str, float] | str:
    """``row`` in a child process given ``argv``: its numbers, or the one line saying why it could not run."""
    command = [sys.executable, "-m", "benchmarks.finetune", "--child", row, *argv]
    done = subprocess.run(command, capture_output=True, text=True, cwd=common.ROOT, timeout=1800)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{row}: failed ({last})"
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser, repeats=3, warmup=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round (default 5)")
    parser.add_argument("--batch", type=int, default=4, help="windows per batch (default 4)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8; alpha is twice it)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"rows to run (default: {','.join(ROWS)})")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:  # (in a child too: it times the windows the report names)
        args.repeats, args.steps, args.seq_len = 1, 2, 64
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    rows = [r for r in args.rows.split(",") if r]
    common.mark_start(args)
    results: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    failures: dict[str, str] = {}
    for _ in range(args.repeats):
        for row in rows:
            if row in failures:
                continue
            got = run_round(row, argv)
            if isinstance(got, str):
                failures[row] = got
            else:
                results[row].append(got)
    report(rows, results, failures, args)


def report(rows: list[str], results: dict[str, list[dict[str, float]]], failures: dict[str, str],
           args: argparse.Namespace) -> None:
    common.header(f"Fine-tuning SmolLM2-135M: batch {args.batch} x {args.seq_len} tokens, LoRA rank {args.rank}",
                  args)
    median = {row: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
              for row, runs in results.items() if runs}
    table = [[row, common.fmt_int(m["trainable"]), f"{m['tokens_per_s']:.0f}",
              common.spread_text([r["tokens_per_s"] for r in results[row]], 0), f"{m['peak_mib']:.0f}",
              f"{m['first_loss']:.4f}"] for row, m in median.items()]
    print(common.table(["row", "trainable", "tokens/s", "spread", "peak MiB", "first loss"], table))
    print()
    for why in failures.values():
        print(f"* {why}")
    for ours, peer in PEERS.items():
        if ours in median and peer in median:
            speed = median[ours]["tokens_per_s"] / median[peer]["tokens_per_s"]
            memory = median[ours]["peak_mib"] / median[peer]["peak_mib"]
            goal = GOALS.get(ours)
            aim = f" (goals: >= {goal[0]}x and <= {goal[1]}x)" if goal else ""
            print(f"{ours} / {peer}: {speed:.2f}x tokens/s, {memory:.2f}x peak memory{aim}")
    common.footer()


if __name__ == "__main__":
    main()
