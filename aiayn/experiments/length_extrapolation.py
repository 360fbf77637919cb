"""Length extrapolation: train on short sequences, test on longer ones.

Four character-level decoders on Tiny Shakespeare, identical but for their positions (sinusoidal, learned,
RoPE, ALiBi), train on ``train_len`` characters and are scored on the same validation characters cut into
longer and longer windows. Learned positions cannot go past their table ("–" in the table)."""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.experiments.base import (
    Budget,
    Experiment,
    Variant,
    fmt,
    markdown_table,
    register,
    write_results,
)

SCHEMES = ("sinusoidal", "learned", "rope", "alibi")


@torch.no_grad()
def loss_by_position(model: nn.Module, tokens: Tensor, length: int, *, n_chars: int,
                     batch_tokens: int = 16384) -> Tensor:
    """Mean next-token loss (nats) at each position of non-overlapping windows of ``length`` + 1 tokens in the
    first ``n_chars`` + 1: tokens (n,) -> (length,) float64."""
    n_windows = min(n_chars, len(tokens) - 1) // length
    if n_windows == 0:
        raise ValueError(f"{len(tokens)} tokens hold no window of {length + 1}; lower the test length")
    starts = torch.arange(n_windows) * length
    total = torch.zeros(length, dtype=torch.float64)
    model.eval()
    for chunk in starts.split(max(1, batch_tokens // length)):
        window = tokens[chunk[:, None] + torch.arange(length + 1)]  # (b, length + 1)
        logits = model(window[:, :-1]).logits  # (b, length, v)
        loss = F.cross_entropy(logits.transpose(1, 2).float(), window[:, 1:], reduction="none")  # (b, length)
        total += loss.double().sum(0)
    return total / n_windows


@register
class LengthExtrapolation(Experiment):
    name = "length-extrapolation"
    description = ("sinusoidal vs learned vs RoPE vs ALiBi positions: char-level decoders trained on 64 "
                   "characters of Tiny Shakespeare, perplexity at 64 ... 1024")
    budgets: ClassVar[dict[str, Budget]] = {
        "full": Budget("full", "4 decoders (4 layers, d_model 128), 600 steps of 32 x 64 characters each; "
                               "test lengths 64-1024 on 32,768 validation characters; 5.1 min of CPU time "
                               "in all, measured",
                       {"steps": 600, "batch_size": 32, "train_len": 64, "d_model": 128, "n_layers": 4,
                        "d_ff": 512, "lengths": [64, 128, 256, 512, 1024], "eval_chars": 32768}),
        "tiny": Budget("tiny", "tiny decoders (2 layers, d_model 32), 8 steps of 8 x 16 characters; test "
                               "lengths 16-64; seconds (the tests)",
                       {"steps": 8, "batch_size": 8, "train_len": 16, "d_model": 32, "n_layers": 2, "d_ff": 64,
                        "lengths": [16, 32, 64], "eval_chars": 1024}),
    }

    def variants(self, budget: Budget) -> list[Variant]:
        s = budget.settings
        longest = max(s["lengths"])
        variants = []
        for scheme in SCHEMES:
            # A learned table stops at the training length; the others are computed for any position.
            max_len = s["train_len"] if scheme == "learned" else longest
            variants.append(Variant(
                name=scheme, group=scheme, label=f"{scheme} positions, trained on {s['train_len']} characters",
                task="shakespeare-char", task_options={"block_size": s["train_len"]},
                # The same model but for its positions; embeddings scaled by sqrt(d_model) (paper
                # section 3.4) for all four, so the added sinusoids do not drown the token vectors.
                model={"positional": scheme, "max_seq_len": max_len, "d_model": s["d_model"],
                       "n_heads": 4, "n_layers": s["n_layers"], "d_ff": s["d_ff"], "scale_embeddings": True,
                       "name": f"length-extrapolation-{scheme}"},
                train={"max_steps": s["steps"], "batch_size": s["batch_size"], "lr": 2e-3, "schedule": "cosine",
                       "warmup_steps": min(100, s["steps"] // 10), "eval_every": s["steps"],
                       "save_every": max(1, s["steps"] // 3), "log_every": max(1, min(50, s["steps"]))},
            ))
        return variants

    def measure(self, variant: Variant, run_dir: Path, budget: Budget) -> dict[str, Any]:
        from aiayn.models import count_parameters
        from aiayn.tasks.runs import for_inference, load_run

        s = budget.settings
        run = load_run(run_dir)
        model = for_inference(run.model)
        tokens = run.task.tokens["val"]  # type: ignore[attr-defined]
        row: dict[str, Any] = {"positional": run.model_config.positional, "params": count_parameters(model),
                               "train_len": s["train_len"], "max_seq_len": run.model_config.max_seq_len}
        curve: list[float] = []
        for length in s["lengths"]:
            if length > run.model_config.max_seq_len:  # past a learned table: nothing to look up
                row[f"ppl@{length}"] = None
                continue
            losses = loss_by_position(model, tokens, length, n_chars=s["eval_chars"])
            row[f"ppl@{length}"] = math.exp(float(losses.mean()))
            curve = losses.tolist()  # the longest length scored, kept for the per-position plot
        row["loss_by_position"] = [round(x, 4) for x in curve]
        return row

    def report(self, rows: list[dict[str, Any]], out_dir: Path, budget: Budget) -> list[Path]:
        s = budget.settings
        lengths = s["lengths"]
        header = ["positions", "params", *[f"ppl @ {n}" for n in lengths]]
        table = markdown_table(header, [[r["positional"], f"{r['params']:,}", *[r[f"ppl@{n}"] for n in lengths]]
                                        for r in rows])
        best = {n: min((r[f"ppl@{n}"] for r in rows if r[f"ppl@{n}"] is not None), default=None) for n in lengths}
        markdown = (
            f"# Length extrapolation ({budget.name} budget)\n\n"
            f"Character-level decoders trained on windows of {s['train_len']} characters of Tiny Shakespeare "
            f"({budget.summary}); validation perplexity per character on the first {s['eval_chars']:,} "
            f"validation characters cut into windows of each length (mean over all positions). "
            f"\"–\": learned positions have no row past position {s['train_len'] - 1}, so those lengths cannot "
            f"be scored (aiayn refuses them).\n\n{table}\n"
            f"Best at each length: " + ", ".join(f"{n}: {fmt(v)}" for n, v in best.items()) + ".\n\n")
        columns = ["variant", "positional", "params", "train_len", "max_seq_len", *[f"ppl@{n}" for n in lengths],
                   "cpu_s", "wall_s"]
        files = write_results(out_dir, markdown=markdown, columns=columns, rows=rows)
        files.append(plot_extrapolation(rows, lengths, s["train_len"], out_dir / "perplexity_vs_length.png"))
        return files


def plot_extrapolation(rows: list[dict[str, Any]], lengths: list[int], train_len: int, path: Path) -> Path:
    """Perplexity against test length, and loss by position of the longest windows each scheme reads."""
    import matplotlib.ticker

    from aiayn import viz

    fig, (ax_len, ax_pos) = viz.plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        scored = [(n, r[f"ppl@{n}"]) for n in lengths if r[f"ppl@{n}"] is not None]
        (line,) = ax_len.plot(*zip(*scored, strict=True), "o-", label=r["positional"])
        if len(scored) < len(lengths):  # where the learned table ends
            ax_len.plot([scored[-1][0]], [scored[-1][1]], "x", ms=14, mew=2.5, color=line.get_color())
            ax_len.annotate(f"{r['positional']}: no positions past {scored[-1][0] - 1}", scored[-1],
                            textcoords="offset points", xytext=(8, 12), fontsize=8, color=line.get_color())
        curve = torch.tensor(r["loss_by_position"])
        if len(curve):  # mean loss in bins half an octave wide, at 1-based positions
            octaves = 2 * math.ceil(math.log2(len(curve)))
            edges = [0, *sorted({min(len(curve), round(2 ** (k / 2))) for k in range(octaves + 1)})]
            centres = [(lo + 1 + hi) / 2 for lo, hi in pairwise(edges)]
            binned = [float(curve[lo:hi].mean()) for lo, hi in pairwise(edges)]
            ax_pos.plot(centres, binned, ".-", label=r["positional"], color=line.get_color())
    for ax in (ax_len, ax_pos):
        ax.axvline(train_len, color="grey", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    ax_len.set_yscale("log")
    ax_len.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_len.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax_len.set(xlabel="test window length (characters)", ylabel="validation perplexity (per character)",
               title=f"trained on {train_len} characters (dashed line)")
    ax_pos.set(xlabel="position in the window (1 = first)", ylabel="loss at that position (nats)",
               title="loss by position (half-octave bins), longest window each reads")
    fig.tight_layout()
    return viz.save_figure(fig, path)
