"""``aiayn experiment``: the paper's experiments, trained small (``aiayn.experiments``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from aiayn.cli.app import check_threads, cli, device_option, resolve_device


@cli.command("experiment")
@click.argument("name", required=False)
@click.option("--budget", help="How much to train (see `aiayn experiment`); default: full.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the variants' runs and the results go. Default: runs/experiments/NAME.")
@click.option("--resume", is_flag=True,
              help="Continue an experiment in --out: finished variants are skipped, an interrupted one resumes.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Variants trained at once, each in its own process.")
@click.option("--threads", type=click.IntRange(min=1), callback=lambda c, p, v: v and check_threads(v),
              help="Torch threads per variant (default: torch's).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@device_option
def experiment_cmd(name: str | None, budget: str | None, out_dir: Path | None, resume: bool, jobs: int,
                   threads: int | None, progress: bool, device: str) -> None:
    """Run an experiment (train its variants, write a results table and a plot); no NAME: list them.

    Example: aiayn experiment length-extrapolation --budget full --out runs/experiments/length-extrapolation
    """
    from aiayn.experiments import experiment_names, get_experiment, run_experiment

    if name is None:
        for known in experiment_names():
            experiment = get_experiment(known)
            click.echo(f"{known}: {experiment.description}")
            for budget_name, spec in experiment.budgets.items():
                click.echo(f"  --budget {budget_name}: {spec.summary}")
        return
    experiment = get_experiment(name)
    where = str(resolve_device(device))  # checked here; each variant's process places itself
    out_dir = out_dir or Path("runs") / "experiments" / name
    command = "aiayn " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["experiment"] else f"aiayn experiment {name}"
    result = run_experiment(experiment, out_dir, budget=budget, resume=resume, jobs=jobs, threads=threads,
                            progress=progress, echo=click.echo, command=command, device=where)
    if result.interrupted:
        raise SystemExit(130)
    click.echo((out_dir / "results.md").read_text(encoding="utf-8"))
