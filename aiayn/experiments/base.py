"""What every experiment shares: variants trained into a run directory each, resumable, measured, reported.

An experiment's output folder::

    OUT/.aiayn-run          marker (kind "experiment"): aiayn made this folder
    OUT/experiment.json     which experiment, which budget, its variants, the command
    OUT/<variant>/          an ordinary run directory (``aiayn train`` layout) + result.json
    OUT/results.md, results.csv, results.json, <plot>.png   written at the end

A variant folder with another config is refused."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, ClassVar

from aiayn.config import ConfigError, ModelConfig, TrainConfig
from aiayn.cpu_share import keep_thread_count
from aiayn.tasks.base import get_task
from aiayn.train.checkpoint import latest_checkpoint
from aiayn.train.run_dir import (
    RunDirError,
    atomic_write_text,
    claim_output_dir,
    config_diff,
    read_marker,
)
from aiayn.train.task import Task

KIND_EXPERIMENT = "experiment"
MANIFEST = "experiment.json"
RESULT = "result.json"
COST = "cost.json"  # in each variant's run: CPU and wall seconds summed over its sessions


class ExperimentError(ConfigError):
    """An experiment that cannot run as asked (unknown name or budget, an output folder in the way)."""


@dataclass(frozen=True)
class Budget:
    """How much an experiment trains; ``summary`` says it in words."""

    name: str
    summary: str
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Variant:
    """One model to train: the task and the config fields that differ from the task's defaults."""

    name: str  # its run directory's name, unique in the experiment
    group: str  # the row group it belongs to (Table 3's "A" ... "E", or the positional scheme)
    label: str  # what is varied, in words
    task: str
    task_options: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields

    def build(self) -> tuple[Task, ModelConfig, TrainConfig]:
        """The task and configs this variant trains with (float32 unless it says otherwise)."""
        task = get_task(self.task, **self.task_options)
        model = ModelConfig.from_dict({**task.model_config().to_dict(), **self.model})
        train = TrainConfig.from_dict({**TrainConfig(task=self.task).to_dict(), "bf16": False,
                                       **task.train_overrides(), **self.train, "task": self.task})
        return task, model, train


class Experiment:
    """A question answered by training: subclasses give the variants, the measurement and the report."""

    name: ClassVar[str]
    description: ClassVar[str]
    budgets: ClassVar[dict[str, Budget]]

    def budget(self, name: str) -> Budget:
        if name not in self.budgets:
            raise ExperimentError(f"experiment {self.name!r} has no budget {name!r}; its budgets are "
                                  f"{', '.join(self.budgets)}")
        return self.budgets[name]

    def variants(self, budget: Budget) -> list[Variant]:
        raise NotImplementedError

    def measure(self, variant: Variant, run_dir: Path, budget: Budget) -> dict[str, Any]:
        """The numbers of one trained variant (a JSON-able mapping), kept in RUN/result.json."""
        raise NotImplementedError

    def report(self, rows: list[dict[str, Any]], out_dir: Path, budget: Budget) -> list[Path]:
        """Write the results table(s) and plot(s); return their paths."""
        raise NotImplementedError


EXPERIMENTS: dict[str, type[Experiment]] = {}


def register(cls: type[Experiment]) -> type[Experiment]:
    EXPERIMENTS[cls.name] = cls
    return cls


def run_configs(task: Task, model: ModelConfig, train: TrainConfig) -> dict[str, Any]:
    """What the trainer writes to a run's config.json (to compare an existing run against)."""
    return json.loads(json.dumps({"task": task.name, "task_options": task.options, "model": model.to_dict(),
                                  "train": train.to_dict()}))


def variant_state(variant: Variant, run_dir: Path) -> str:
    """"measured", "trained", "interrupted" or "new"; a run there with another config is a RunDirError."""
    if not (run_dir / "config.json").is_file():
        return "new"
    task, model, train = variant.build()
    saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    differences = config_diff(saved, run_configs(task, model, train))
    if differences:
        raise RunDirError(f"{run_dir} was trained with another config than variant {variant.name!r} "
                          f"({'; '.join(differences[:3])}); give the experiment a new --out")
    if (run_dir / RESULT).is_file():
        return "measured"
    if (run_dir / "summary.json").is_file():
        return "trained"
    return "interrupted" if latest_checkpoint(run_dir / "checkpoints") is not None else "new"


def run_variant(experiment: Experiment, variant: Variant, run_dir: Path, budget: Budget, *,
                progress: bool = True, echo: Callable[[str], None] = print,
                threads: int | None = None, device: str | None = None) -> dict[str, Any]:
    """Train (or resume) one variant, measure it once, return its row (``interrupted`` after Ctrl-C)."""
    import torch

    from aiayn.train.trainer import train

    if threads is not None:
        torch.set_num_threads(threads)
    keep_thread_count()  # a variant's numbers must not depend on --jobs or other jobs (aiayn/cpu_share.py)
    state = variant_state(variant, run_dir)
    if state == "measured":
        return json.loads((run_dir / RESULT).read_text(encoding="utf-8"))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if state in ("new", "interrupted"):
        task, model, train_config = variant.build()
        result = train(task, model, train_config, run_dir, resume=state == "interrupted",
                       overwrite=state == "new" and run_dir.is_dir() and any(run_dir.iterdir()),
                       progress=progress, echo=echo, make_plots=False, device=device)
        if result.interrupted:
            _add_cost(run_dir, time.process_time() - cpu0, time.perf_counter() - wall0)
            return {"variant": variant.name, "interrupted": True}
    row = {"variant": variant.name, "group": variant.group, "label": variant.label,
           **experiment.measure(variant, run_dir, budget)}
    # The cost over every session of this variant (interrupted ones included), for the budget note.
    row.update(_add_cost(run_dir, time.process_time() - cpu0, time.perf_counter() - wall0))
    atomic_write_text(run_dir / RESULT, json.dumps(row, indent=2) + "\n")
    return row


def _add_cost(run_dir: Path, cpu_s: float, wall_s: float) -> dict[str, float]:
    """Add one session's CPU and wall seconds to RUN/cost.json; return the totals."""
    path = run_dir / COST
    cost = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"cpu_s": 0.0, "wall_s": 0.0}
    cost = {"cpu_s": round(cost["cpu_s"] + cpu_s, 1), "wall_s": round(cost["wall_s"] + wall_s, 1)}
    atomic_write_text(path, json.dumps(cost) + "\n")
    return cost


def _worker(name: str, variant: Variant, run_dir: str, budget_name: str, threads: int | None,
            device: str | None = None) -> dict[str, Any]:
    """One variant in a worker process (``jobs`` > 1): no progress bar, lines prefixed by its name."""
    experiment = EXPERIMENTS[name]()  # registered: importing this module ran the package's __init__
    return run_variant(experiment, variant, Path(run_dir), experiment.budget(budget_name), progress=False,
                       echo=lambda line: print(f"[{variant.name}] {line}", flush=True), threads=threads,
                       device=device)


@dataclass
class ExperimentResult:
    rows: list[dict[str, Any]]
    interrupted: bool = False


def prepare_out_dir(experiment: Experiment, out_dir: Path, budget: Budget, *, resume: bool,
                    variants: Sequence[Variant], command: str) -> None:
    """Claim ``out_dir`` for this experiment, or refuse another's results or a folder aiayn did not make."""
    manifest_path = out_dir / MANIFEST
    first = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else None
    if first is not None:
        if first.get("experiment") != experiment.name:
            raise ExperimentError(f"{out_dir} holds the results of experiment {first.get('experiment')!r}; "
                                  f"choose another --out")
        if not resume:
            raise ExperimentError(f"{out_dir} already holds {experiment.name} results; pass --resume to "
                                  f"continue it (finished variants are skipped) or choose another --out")
        if first.get("budget") != budget.name:
            raise ExperimentError(f"{out_dir} was started with --budget {first.get('budget')}, not "
                                  f"{budget.name}; resume it with that budget or choose another --out")
    elif out_dir.is_dir() and any(out_dir.iterdir()) and (read_marker(out_dir) or {}).get("kind") != KIND_EXPERIMENT:
        raise ExperimentError(f"refusing to write into {out_dir}: it is not empty and aiayn did not create "
                              f"it for an experiment; choose a new or empty --out")
    claim_output_dir(out_dir, kind=KIND_EXPERIMENT)
    manifest = {"experiment": experiment.name, "budget": budget.name, "budget_summary": budget.summary,
                "variants": [v.name for v in variants], "command": command,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if first is not None:  # keep when and how it was first started; list the resumptions
        resumed = first.get("resumed_with", [])
        manifest.update(started=first.get("started"), command=first.get("command", command),
                        resumed_with=resumed if command in resumed else [*resumed, command])
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2) + "\n")


def run_experiment(experiment: Experiment, out_dir: Path, *, budget: str | None = None, resume: bool = False,
                   jobs: int = 1, threads: int | None = None, progress: bool = True,
                   echo: Callable[[str], None] = print, command: str = "",
                   device: str | None = None) -> ExperimentResult:
    """Train, measure and report every variant of ``experiment`` under ``out_dir``; ``jobs`` > 1 trains that
    many at once, each in its own process."""
    chosen = experiment.budget(budget or "full")
    variants = experiment.variants(chosen)
    out_dir = Path(out_dir)
    prepare_out_dir(experiment, out_dir, chosen, resume=resume, variants=variants, command=command)
    echo(f"experiment {experiment.name} ({chosen.name} budget: {chosen.summary}) -> {out_dir}")
    states = {v.name: variant_state(v, out_dir / v.name) for v in variants}
    rows: dict[str, dict[str, Any]] = {}
    todo = []
    for i, variant in enumerate(variants, 1):
        state = states[variant.name]
        if state == "measured":
            echo(f"[{i}/{len(variants)}] {variant.name}: done earlier, skipped")
            rows[variant.name] = run_variant(experiment, variant, out_dir / variant.name, chosen)
        else:
            todo.append((i, variant, state))
    interrupted = False
    if jobs <= 1:
        for i, variant, state in todo:
            what = {"new": "training", "interrupted": "resuming from its checkpoint", "trained": "measuring"}[state]
            echo(f"[{i}/{len(variants)}] {variant.name} ({variant.label}): {what}")
            row = run_variant(experiment, variant, out_dir / variant.name, chosen, progress=progress,
                              echo=echo, threads=threads, device=device)
            if row.get("interrupted"):
                interrupted = True
                break
            rows[variant.name] = row
            echo(f"[{i}/{len(variants)}] {variant.name}: {_brief(row)}")
    elif todo:
        echo(f"training {len(todo)} variant(s), {jobs} at a time (each in its own process)")
        # At most ``jobs`` variants are handed out at a time (none waits in the pool's queue): on
        # Ctrl-C each worker saves its checkpoint and returns, and nothing further starts.
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
        queue = [variant for _, variant, _ in todo]
        running: dict[Future[dict[str, Any]], Variant] = {}
        try:
            while queue or running:
                while queue and len(running) < jobs and not interrupted:
                    variant = queue.pop(0)
                    running[pool.submit(_worker, experiment.name, variant, str(out_dir / variant.name),
                                        chosen.name, threads, device)] = variant
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    variant, row = running.pop(future), future.result()
                    if row.get("interrupted"):
                        interrupted = True
                        continue
                    rows[variant.name] = row
                    echo(f"[{len(rows)}/{len(variants)}] {variant.name}: {_brief(row)}")
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    if interrupted:
        echo(f"interrupted: the variants finished so far are kept; continue with --resume --out {out_dir}")
        return ExperimentResult([rows[v.name] for v in variants if v.name in rows], interrupted=True)
    ordered = [rows[v.name] for v in variants]
    files = experiment.report(ordered, out_dir, chosen)
    echo("results: " + ", ".join(str(f) for f in files))
    return ExperimentResult(ordered)


def _brief(row: dict[str, Any]) -> str:
    shown = [f"{k} {v:.4g}" for k, v in row.items()  # the scores: perplexities, BLEU
             if isinstance(v, float) and ("ppl" in k or "bleu" in k) and math.isfinite(v)][:5]
    return ", ".join(shown) + f" ({row.get('cpu_s', 0):.0f} s CPU, {row.get('wall_s', 0):.0f} s wall)"


def fmt(value: Any) -> str:
    """A table cell: numbers rounded, None as an en dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(cell) if not isinstance(cell, str) else cell for cell in row) + " |"
              for row in rows]
    return "\n".join(lines) + "\n"


def write_results(out_dir: Path, *, markdown: str, columns: Sequence[str], rows: list[dict[str, Any]],
                  extra: dict[str, Any] | None = None) -> list[Path]:
    """results.md (``markdown``, the cost and the commands), results.csv and results.json (rows + extra)."""
    import csv
    import io

    manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    commands = [f"Made by: `{manifest.get('command', '')}`",
                *(f"continued with: `{command}`" for command in manifest.get("resumed_with", []))]
    cpu, wall = (sum(r.get(key, 0.0) for r in rows) for key in ("cpu_s", "wall_s"))
    md = out_dir / "results.md"
    atomic_write_text(md, f"{markdown}Cost: {len(rows)} variants, {cpu / 60:.1f} min of CPU time and "
                          f"{wall / 60:.1f} min of wall time in all (summed over the variants and their "
                          f"sessions).\n\n" + ";\n".join(commands) + "\n")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    csv_path = out_dir / "results.csv"
    atomic_write_text(csv_path, buffer.getvalue())
    json_path = out_dir / "results.json"
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    atomic_write_text(json_path, json.dumps({**manifest, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                             "load_average_at_end": load, "rows": rows, **(extra or {})},
                                            indent=2) + "\n")
    return [md, csv_path, json_path]
