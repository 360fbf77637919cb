"""The paper's Table 3 (model variations), rows (A)-(E), at Multi30k scale.

Every variant is a small base model (N = 2, d_model = 128, d_ff = 512, h = 8) with one change as in the paper,
trained for the same steps on Multi30k en->de and scored on the validation split (perplexity and greedy BLEU)
beside the paper's numbers; a second base seed gives the noise. (B) shrinks d_v with d_k, and the learning
rate is a cosine schedule peaking at 3e-3."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

from aiayn.experiments.base import (
    Budget,
    Experiment,
    Variant,
    markdown_table,
    register,
    write_results,
)

# Table 3 of the paper, as printed, for the row each variant stands for: (the paper's row,
# PPL dev, BLEU dev, params x 10^6 or None where not printed).
PAPER = {
    "base": ("base", 4.92, 25.8, 65),
    "A-h1": ("h=1, d_k=d_v=512", 5.29, 24.9, None), "A-h4": ("h=4, d_k=d_v=128", 5.00, 25.5, None),
    "A-h16": ("h=16, d_k=d_v=32", 4.91, 25.8, None), "A-h32": ("h=32, d_k=d_v=16", 5.01, 25.4, None),
    "B-dk-quarter": ("d_k=16", 5.16, 25.1, 58), "B-dk-half": ("d_k=32", 5.01, 25.4, 60),
    "C-N1": ("N=2", 6.11, 23.7, 36), "C-N3": ("N=8", 4.88, 25.5, 80),
    "C-d_model-half": ("d_model=256, d_k=d_v=32", 5.75, 24.5, 28),
    "C-d_model-double": ("d_model=1024, d_k=d_v=128", 4.66, 26.0, 168),
    "C-d_ff-half": ("d_ff=1024", 5.12, 25.4, 53), "C-d_ff-double": ("d_ff=4096", 4.75, 26.2, 90),
    "D-dropout-0": ("P_drop=0.0", 5.77, 24.6, None), "D-dropout-0.2": ("P_drop=0.2", 4.95, 25.5, None),
    "D-ls-0": ("eps_ls=0.0", 4.67, 25.3, None), "D-ls-0.2": ("eps_ls=0.2", 5.47, 25.7, None),
    "E-learned": ("positional embedding", 4.92, 25.7, None),
}
# What the paper says each group shows (section 6.2), to hold our numbers against.
PAPER_FINDING = {
    "A": "single-head attention is worst and quality also drops with too many heads",
    "B": "reducing the attention key size d_k hurts model quality",
    "C": "bigger models are better (deeper, wider, wider feed-forward)",
    "D": "dropout is very helpful in avoiding over-fitting; label smoothing hurts perplexity but helps BLEU",
    "E": "learned positional embeddings give nearly identical results to the sinusoids",
}


@register
class Table3(Experiment):
    name = "table3"
    description = ("the paper's Table 3 rows (A)-(E) on Multi30k en->de: heads, d_k, model size, dropout and "
                   "label smoothing, learned positions; val PPL and greedy BLEU beside the paper's")
    budgets: ClassVar[dict[str, Budget]] = {
        "full": Budget("full", "19 models (base N=2, d_model 128), 500 steps of 2,048 tokens each (about 2.1 "
                               "epochs of Multi30k); about 45 min of one core in all",
                       {"steps": 500, "warmup": 50, "max_tokens": 2048, "vocab_size": 4000, "n_layers": 2,
                        "d_model": 128, "d_ff": 512, "n_heads": 8, "lr": 3e-3}),
        "tiny": Budget("tiny", "19 tiny models (d_model 32), 4 steps each; seconds (the tests)",
                       {"steps": 4, "warmup": 1, "max_tokens": 256, "vocab_size": 120, "n_layers": 2,
                        "d_model": 32, "d_ff": 64, "n_heads": 8, "lr": 3e-3}),
    }

    def variants(self, budget: Budget) -> list[Variant]:
        s = budget.settings
        d, d_ff, n, h = s["d_model"], s["d_ff"], s["n_layers"], s["n_heads"]
        d_k = d // h
        rows: list[tuple[str, str, str, dict[str, Any]]] = [
            ("base", "base", f"base: N={n}, d_model={d}, d_ff={d_ff}, h={h}, d_k=d_v={d_k}, P_drop=0.1, eps_ls=0.1", {}),
            ("base-seed1", "base", "base again, seed 1 (run-to-run spread)", {"seed": 1}),
            *[(f"A-h{heads}", "A", f"h={heads}, d_k=d_v={d // heads}", {"n_heads": heads}) for heads in (1, 4, 16, 32)],
            ("B-dk-quarter", "B", f"d_k=d_v={d_k // 4}", {"head_dim": d_k // 4}),
            ("B-dk-half", "B", f"d_k=d_v={d_k // 2}", {"head_dim": d_k // 2}),
            *[(f"C-N{layers}", "C", f"N={layers}", {"n_layers": layers}) for layers in (n // 2, n + n // 2)],
            ("C-d_model-half", "C", f"d_model={d // 2}, d_k=d_v={d_k // 2}", {"d_model": d // 2}),
            ("C-d_model-double", "C", f"d_model={d * 2}, d_k=d_v={d_k * 2}", {"d_model": d * 2}),
            ("C-d_ff-half", "C", f"d_ff={d_ff // 2}", {"d_ff": d_ff // 2}),
            ("C-d_ff-double", "C", f"d_ff={d_ff * 2}", {"d_ff": d_ff * 2}),
            ("D-dropout-0", "D", "P_drop=0.0", {"dropout": 0.0}),
            ("D-dropout-0.2", "D", "P_drop=0.2", {"dropout": 0.2}),
            ("D-ls-0", "D", "eps_ls=0.0", {"label_smoothing": 0.0}),
            ("D-ls-0.2", "D", "eps_ls=0.2", {"label_smoothing": 0.2}),
            ("E-learned", "E", "learned positional embedding instead of sinusoids", {"positional": "learned"}),
        ]
        return [self._variant(name, group, label, change, s) for name, group, label, change in rows]

    @staticmethod
    def _variant(name: str, group: str, label: str, change: dict[str, Any], s: dict[str, Any]) -> Variant:
        model = {"d_model": s["d_model"], "n_heads": s["n_heads"], "n_layers": s["n_layers"], "n_decoder_layers": None,
                 "d_ff": s["d_ff"], "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
                 "positional": "sinusoidal", "padding_free": True, "name": f"table3-{name}"}
        # Every setting pinned, not the translation task's defaults (they may change); "epochs" never
        # binds (max_steps stops first) but is in the run's config, which a resumed variant must match.
        train = {"max_steps": s["steps"], "epochs": 30, "schedule": "cosine", "warmup_steps": s["warmup"], "optimizer": "adam",
                 "label_smoothing": 0.1, "clip_grad_norm": 1.0, "seed": 0, "eval_every": s["steps"],
                 "save_every": max(1, s["steps"] // 5), "keep_checkpoints": 1, "average_last": 0,
                 "log_every": min(50, s["steps"])}
        for key, value in change.items():
            (train if key in ("seed", "label_smoothing") else model)[key] = value
        # The paper's schedule scales the rate as d_model^-0.5 (eq. 3); so does this cosine's peak.
        train["lr"] = s["lr"] * math.sqrt(s["d_model"] / model["d_model"])
        return Variant(name=name, group=group, label=label, task="translation",
                       # The final scoring ("test" split) is the validation split, greedy; test2016 is never read.
                       task_options={"vocab_size": s["vocab_size"], "max_tokens": s["max_tokens"],
                                     "val_bleu": False, "test_split": "val", "beam_size": 1},
                       model=model, train=train)

    def measure(self, variant: Variant, run_dir: Path, budget: Budget) -> dict[str, Any]:
        from aiayn.config import ModelConfig
        from aiayn.models import build_model, count_parameters

        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        model_config = ModelConfig.from_dict(config["model"])
        scores = summary["test"]  # the validation split (test_split="val"), greedy
        paper = PAPER.get(variant.name.replace("-seed1", ""), (None, None, None, None))
        return {"n_layers": model_config.n_layers, "d_model": model_config.d_model, "d_ff": model_config.d_ff,
                "n_heads": model_config.n_heads, "head_dim": model_config.head_dim,
                "dropout": model_config.dropout, "label_smoothing": config["train"]["label_smoothing"],
                "positional": model_config.positional, "params": count_parameters(build_model(model_config)),
                "val_ppl": math.exp(scores["nll"]), "val_bleu": scores["bleu"], "val_chrf": scores["chrf"],
                "train_loss": summary["final_train_loss"],
                "paper_row": paper[0], "paper_ppl": paper[1], "paper_bleu": paper[2], "paper_params_m": paper[3]}

    def report(self, rows: list[dict[str, Any]], out_dir: Path, budget: Budget) -> list[Path]:
        base = rows[0]
        header = ["row", "variant (ours)", "params", "val PPL", "val BLEU (greedy)", "paper's row", "paper PPL (dev)",
                  "paper BLEU (dev)", "paper params (M)"]
        table = markdown_table(header, [[r["group"], r["label"], f"{r['params']:,}", r["val_ppl"], r["val_bleu"],
                                         r["paper_row"], r["paper_ppl"], r["paper_bleu"], r["paper_params_m"]]
                                        for r in rows])
        spread = [r for r in rows if r["variant"] == "base-seed1"]
        noise = (f"The two base runs (seeds 0 and 1) differ by {abs(spread[0]['val_ppl'] - base['val_ppl']):.2f} "
                 f"PPL and {abs(spread[0]['val_bleu'] - base['val_bleu']):.2f} BLEU: smaller differences "
                 f"are within run-to-run noise.\n\n") if spread else ""
        trends = "".join(f"* ({group}) {line}\n" for group, line in trend_lines(rows).items())
        markdown = (
            f"# Table 3, reproduced small ({budget.name} budget)\n\n"
            f"Multi30k en->de, {budget.summary}. Our columns: the validation split, "
            f"perplexity per BPE token and greedy-decoding BLEU (sacreBLEU). The paper's: newstest2013 "
            f"(dev), per-wordpiece perplexity, beam search, 100K steps of the 65M-parameter base. Compare "
            f"directions within a row group, not magnitudes.\n\n{table}\n{noise}"
            f"Does the paper's trend hold here? (direction of each row's change from the base, ours vs "
            f"the paper's)\n\n{trends}\n")
        columns = ["variant", "group", "label", "n_layers", "d_model", "d_ff", "n_heads", "head_dim", "dropout",
                   "label_smoothing", "positional", "params", "val_ppl", "val_bleu", "val_chrf", "train_loss",
                   "paper_row", "paper_ppl", "paper_bleu", "paper_params_m", "cpu_s", "wall_s"]
        files = write_results(out_dir, markdown=markdown, columns=columns, rows=rows,
                              extra={"paper_findings": PAPER_FINDING})
        files.append(plot_table3(rows, out_dir / "table3.png"))
        return files


def trend_lines(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Per row group: the paper's finding, and in how many rows our PPL and BLEU moved its way."""
    base = rows[0]
    seed = next((r for r in rows if r["variant"] == "base-seed1"), None)
    ppl_noise = abs(seed["val_ppl"] - base["val_ppl"]) if seed else 0.0
    bleu_noise = abs(seed["val_bleu"] - base["val_bleu"]) if seed else 0.0
    lines = {}
    for group in "ABCDE":
        members = [r for r in rows if r["group"] == group and r["paper_ppl"] is not None]
        if not members:
            continue
        ppl_agree = sum(_same_direction(r["val_ppl"] - base["val_ppl"], r["paper_ppl"] - base["paper_ppl"], ppl_noise)
                        for r in members)
        bleu_agree = sum(_same_direction(r["val_bleu"] - base["val_bleu"], r["paper_bleu"] - base["paper_bleu"],
                                         bleu_noise) for r in members)
        best = min([*members, base], key=lambda r: r["val_ppl"])
        lines[group] = (f"paper: {PAPER_FINDING[group]}. Here PPL moves the paper's way in {ppl_agree} of "
                        f"{len(members)} rows and BLEU in {bleu_agree} of {len(members)}; lowest PPL of the "
                        f"group (with the base): {best['label'].split(':')[0]} ({best['val_ppl']:.2f}).")
    return lines


def _same_direction(ours: float, paper: float, noise: float) -> bool:
    """Both changes point the same way; a change within ``noise`` (or the paper's 0) counts as none."""
    ours_sign = 0 if abs(ours) <= noise else (1 if ours > 0 else -1)
    paper_sign = 0 if paper == 0 else (1 if paper > 0 else -1)
    return ours_sign == paper_sign


def plot_table3(rows: list[dict[str, Any]], path: Path) -> Path:
    """Each variant's change from the base, ours beside the paper's, with the base runs' spread."""
    from aiayn import viz

    base = rows[0]
    seed = next((r for r in rows if r["variant"] == "base-seed1"), None)
    shown = [r for r in rows[1:] if r["paper_ppl"] is not None or r is seed]
    labels = [f"({r['group']}) {r['label']}" + (f"  [paper: {r['paper_row']}]" if r["group"] in "ABC" else "")
              for r in shown]
    y = list(range(len(shown)))
    fig, (ax_ppl, ax_bleu) = viz.plt.subplots(1, 2, figsize=(14, 0.38 * len(shown) + 1.6), sharey=True)
    for ax, key, paper_key, relative in ((ax_ppl, "val_ppl", "paper_ppl", True),
                                         (ax_bleu, "val_bleu", "paper_bleu", False)):
        def change(value: float | None, reference: float, relative: bool = relative) -> float:
            if value is None:
                return float("nan")
            return 100 * (value / reference - 1) if relative else value - reference

        ours = [change(r[key], base[key]) for r in shown]
        paper = [change(r[paper_key], base[paper_key]) for r in shown]
        if seed is not None:
            noise = abs(change(seed[key], base[key]))
            ax.axvspan(-noise, noise, color="grey", alpha=0.2, label="spread of two base runs")
        ax.barh([i - 0.2 for i in y], ours, height=0.4, label="ours (Multi30k val, small)")
        ax.barh([i + 0.2 for i in y], paper, height=0.4, label="paper (newstest2013)")
        ax.axvline(0.0, color="black", lw=0.8)
        ax.set_xlabel("PPL change from the base, % (lower is better)" if relative
                      else "BLEU change from the base, points (higher is better)")
        ax.legend(fontsize=8)
    ax_ppl.set_yticks(y, labels, fontsize=8)
    ax_ppl.invert_yaxis()
    fig.suptitle("Table 3 variations: change from the base model")
    fig.tight_layout()
    return viz.save_figure(fig, path)
