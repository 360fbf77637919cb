"""A run directory's training record for the page: metrics.csv, config.json and summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from aiayn.viz import MetricsError, read_metrics

MAX_POINTS = 2000  # points per series sent to the page (a long run is thinned evenly)

TRAIN_FIELDS = ("train_loss", "train_nll", "train_acc", "lr", "tokens_per_s")
VAL_FIELDS = ("val_nll", "val_ppl", "val_acc", "val_seq_acc", "val_bleu")


def _thin(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    if len(rows) <= MAX_POINTS:
        return rows
    stride = math.ceil(len(rows) / MAX_POINTS)
    return rows[::stride] if rows[-1] is rows[::stride][-1] else [*rows[::stride], rows[-1]]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def run_record(run_dir: Path | None) -> dict[str, Any]:
    """{"available": False, "reason"} for a model without a run; else the series and configs."""
    if run_dir is None:
        return {"available": False,
                "reason": "this model was loaded from a file, not trained here: it has no run to show"}
    from aiayn.tasks.trained import is_release

    # A shipped model keeps its run's record in record/ (config.json stays beside the weights).
    record = run_dir / "record" if is_release(run_dir) else run_dir
    metrics = record / "metrics.csv"
    try:
        rows = read_metrics(metrics) if metrics.is_file() else []
        damaged = None
    except MetricsError as exc:  # the page shows the rest of the run, and says why no curves
        rows, damaged = [], str(exc)
    series: dict[str, list[list[float]]] = {}
    for name in (*TRAIN_FIELDS, *VAL_FIELDS):
        points = _thin([r for r in rows if name in r])  # read_metrics keeps rows with a step only
        if points:
            series[name] = [[r["step"], r[name]] for r in points]
    return {"available": True, "run": str(run_dir), "series": series, "rows": len(rows),
            "config": _read_json(run_dir / "config.json"), "summary": _read_json(record / "summary.json"),
            "note": damaged or (None if rows else "metrics.csv is missing or empty")}
