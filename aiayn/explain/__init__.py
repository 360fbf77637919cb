"""``aiayn explain TOPIC``: classic questions about the Transformer answered by small experiments, each
writing tables, a plot and a markdown page. A module per topic: ``TITLE``, ``QUESTION``, ``run``."""

from __future__ import annotations

import importlib
import inspect
import time
from pathlib import Path
from types import ModuleType

import torch

from aiayn.explain.base import Report

# topic name -> module in this package, in the order of the docs (the paper's order)
TOPICS = {
    "scaling": "scaling",          # why divide by sqrt(d_k)
    "masks": "masking",            # what the mask does to the softmax
    "heads": "heads",              # one head vs h heads: the same parameters and FLOPs
    "additive": "additive",        # dot-product vs additive attention
    "shared-qk": "shared_qk",      # one projection for queries and keys
    "positional": "positional",    # the sinusoidal encoding
    "table1": "table1",            # the paper's Table 1, measured
    "parameters": "parameters",    # what Table 3's parameter counts include
}


def topic(name: str) -> ModuleType:
    """The module of topic ``name``; ValueError naming the topics for an unknown one."""
    if name not in TOPICS:
        raise ValueError(f"unknown topic {name!r}; topics: {', '.join(TOPICS)}")
    return importlib.import_module(f"aiayn.explain.{TOPICS[name]}")


def run_topic(name: str, out_dir: Path, *, quick: bool = False, command: str | None = None,
              device: torch.device | None = None) -> Report:
    """Run a topic: its report, plots and page ``out_dir/NAME.md``; ``device``: where it trains (or CPU)."""
    module = topic(name)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    trains = "device" in inspect.signature(module.run).parameters  # the topics that train take a device
    extra = {"device": device} if device is not None and trains else {}
    report = module.run(out_dir, quick=quick, **extra)
    report.seconds = time.perf_counter() - start
    command = command or f"aiayn explain {name}" + (" --quick" if quick else "")
    source = f"aiayn/explain/{TOPICS[name]}.py"  # the module's file, not the topic's name (masks: masking.py)
    (out_dir / f"{name}.md").write_text(report.markdown(command, source), encoding="utf-8")
    return report


def index_page(out_dir: Path) -> Path:
    lines = ["# The classic questions, answered by experiments", "",
             "Each page is written by `aiayn explain TOPIC --out docs/explain` (all of them: "
             "`aiayn explain --all --out docs/explain`); its numbers are that run's.", ""]
    for name in TOPICS:
        module = topic(name)
        lines.append(f"* [{module.TITLE}]({name}.md) — {module.QUESTION} (`aiayn explain {name}`)")
    path = out_dir / "README.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
