"""The paper's experiments, small enough for a CPU: ``aiayn experiment NAME`` trains the variants of an
``@register``ed ``Experiment``, measures them and writes a results table and a plot."""

from __future__ import annotations

import difflib

from aiayn.experiments import length_extrapolation, table3  # noqa: F401  (register themselves)
from aiayn.experiments.base import (
    EXPERIMENTS,
    Budget,
    Experiment,
    ExperimentError,
    ExperimentResult,
    Variant,
    register,
    run_experiment,
    run_variant,
)

__all__ = ["EXPERIMENTS", "Budget", "Experiment", "ExperimentError", "ExperimentResult", "Variant",
           "get_experiment", "register", "run_experiment", "run_variant"]


def get_experiment(name: str) -> Experiment:
    """The experiment called ``name``; an unknown name is an ExperimentError naming the closest."""
    if name not in EXPERIMENTS:
        close = difflib.get_close_matches(str(name), EXPERIMENTS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ExperimentError(f"unknown experiment {name!r}{hint}; known: {', '.join(sorted(EXPERIMENTS))}")
    return EXPERIMENTS[name]()


def experiment_names() -> list[str]:
    return sorted(EXPERIMENTS)
