"""Checkpoint averaging (the paper's section 6.1) at the end of a run and in ``aiayn average``: the newest
min(N, found) checkpoints into ``averaged-lastK``; test is scored with the better of last and averaged."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from aiayn.train import distributed
from aiayn.train.checkpoint import (
    CheckpointError,
    average_last_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from aiayn.train.task import Task


@dataclass(frozen=True)
class AveragePlan:
    """What averaging the last ``asked`` checkpoints of ``checkpoint_dir`` does."""

    checkpoint_dir: Path
    asked: int
    found: list[Path]  # every complete checkpoint, oldest first (at least one)

    @property
    def count(self) -> int:  # K: the checkpoints really averaged
        return min(self.asked, len(self.found))

    @property
    def averages(self) -> bool:
        return self.count >= 2

    @property
    def folder_name(self) -> str:
        return f"averaged-last{self.count}"

    @property
    def last(self) -> Path:
        return self.found[-1]

    def warning(self) -> str | None:
        """One line when the plan is not what was asked."""
        where = f"{self.checkpoint_dir} keeps {len(self.found)}"
        if not self.averages:
            asked = ("averaging the last 1 checkpoint" if self.asked == 1
                     else f"asked to average the last {self.asked} checkpoints but {where}")
            return f"warning: {asked}: nothing to average, {self.last.name} stands as it is"
        if self.count < self.asked:
            return (f"warning: asked to average the last {self.asked} checkpoints but {where}: "
                    f"averaging {self.count} into {self.folder_name}")
        return None


def plan_average(checkpoint_dir: Path, asked: int) -> AveragePlan:
    """The averaging of the newest ``asked`` checkpoints; CheckpointError if there are none."""
    found = list_checkpoints(checkpoint_dir)
    if not found:
        raise CheckpointError(f"{checkpoint_dir} holds no checkpoints to average")
    return AveragePlan(checkpoint_dir=checkpoint_dir, asked=asked, found=found)


def choose_test_checkpoint(task: Task, model: nn.Module, run_path: Path, asked: int, *,
                           last_val: dict[str, float] | None, ctx: distributed.DistContext,
                           echo: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Average the run's last ``asked`` checkpoints (0: off), leaving in ``model`` the better of last and
    averaged on val -> (``test_checkpoint`` record, ``averaged`` record or {}); ``last_val``: if scored."""
    ckpt_dir = run_path / "checkpoints"
    last_path = latest_checkpoint(ckpt_dir)
    record: dict[str, Any] = {"used": "last", "checkpoint": str(last_path) if last_path else None}
    if not asked:
        return record, {}
    plan = plan_average(ckpt_dir, asked)
    if (warning := plan.warning()) is not None:
        echo(warning)
    if not plan.averages:
        record["reason"] = f"nothing to average: {len(plan.found)} checkpoint(s) kept, {asked} asked"
        return record, {}
    if last_val is None:
        last_val = task.evaluate(model, "val")
    out_dir = run_path / plan.folder_name
    saved = distributed.run_on_main(ctx, lambda: average_last_checkpoints(ckpt_dir, plan.count, model, out_dir))
    if ctx.enabled and not ctx.is_main:  # rank 0 has written the averaged checkpoint: load it
        load_checkpoint(latest_checkpoint(out_dir), model)
    averaged_val = task.evaluate(model, "val")
    averaged = {"checkpoint": str(saved or out_dir), "checkpoints_averaged": plan.count, "asked": asked,
                "val": averaged_val}
    key = "bleu" if "bleu" in last_val and "bleu" in averaged_val else "nll"
    a, b = averaged_val[key], last_val[key]
    use_averaged = a > b if key == "bleu" else a < b  # a tie keeps the last checkpoint: it was trained, not made
    if not use_averaged:  # every rank reads the same file back (the model holds the average now)
        load_checkpoint(last_path or plan.last, model)
    record = {"used": "averaged" if use_averaged else "last",
              "checkpoint": averaged["checkpoint"] if use_averaged else str(last_path),
              "chosen_by": f"val {key}", "val": {"last": b, "averaged": a}}
    echo(f"averaged the last {plan.count} checkpoints -> {out_dir}; val "
         + ", ".join(f"{k} {v:.4f}" for k, v in averaged_val.items()))
    return record, averaged


def describe_choice(record: dict[str, Any]) -> str | None:
    """Which weights scored the test split and why; None when averaging was off."""
    if "val" not in record:
        return f"the last checkpoint ({record['reason']})" if "reason" in record else None
    val, key = record["val"], record["chosen_by"]
    if record["used"] == "averaged":  # its folder, averaged-lastK (rank 0 records the step inside it)
        name = next((p for p in reversed(Path(record["checkpoint"]).parts) if p.startswith("averaged-")), "")
        return (f"the averaged checkpoint {name}, better on {key} ({val['averaged']:.4g} vs "
                f"{val['last']:.4g} for the last)")
    return f"the last checkpoint, better on {key} ({val['last']:.4g} vs {val['averaged']:.4g} averaged)"
