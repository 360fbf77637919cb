"""The divergence guard: a NaN or infinite loss, gradient norm or weight stops training at that step
with a message naming it, saves nothing after it (the last good checkpoint stays ``latest`` and no
good checkpoint is pruned) and exits with code 1. Non-finite numbers and out-of-range seeds are
refused when the options are parsed (exit code 2).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from aiayn.config import TrainConfig
from aiayn.tasks.reverse import ReverseTask
from aiayn.train import checkpoint as ckpt
from aiayn.train.task import Batch
from aiayn.train.trainer import TrainingDiverged, train

RECIPE = "task: reverse\ntask_options: {n_train: 512, n_val: 32, n_test: 32}\n"


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: relative name -> (size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.lstat().st_size if p.is_file() else 0, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


class Sabotaged(ReverseTask):
    """Reverse, made to diverge at training step ``at``: its logits become NaN (``what="loss"``) or
    its gradient infinite while the loss stays finite (``what="grad"``)."""

    def __init__(self, at: int, what: str) -> None:
        super().__init__(n_train=512, n_val=32, n_test=32)
        self.at, self.what, self.steps = at, what, 0

    def forward(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        logits, labels = super().forward(model, batch)
        if model.training:
            self.steps += 1  # one micro-batch per step here
            if self.steps >= self.at and self.what == "loss":
                logits = logits * float("nan")
            elif self.steps == self.at and self.what == "grad":
                logits.register_hook(lambda grad: grad * float("inf"))
        return logits, labels


def sabotaged_run(tmp_path: Path, at: int, what: str, **train_kw: object) -> tuple[TrainingDiverged, Path]:
    task = Sabotaged(at, what)
    cfg = TrainConfig(**{**task.train_overrides(), "max_steps": 8, "batch_size": 64, "save_every": 1,
                         "keep_checkpoints": 2, "eval_every": 1000, "log_every": 1, **train_kw})
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as info:
        train(task, task.model_config(), cfg, run, progress=False, make_plots=False)
    return info.value, run


def assert_good_checkpoints_kept(run: Path, last_good: int, last_logged: int | None = None) -> None:
    """``latest`` is ``last_good``, the kept checkpoints are the two before the divergence, their
    weights are finite, and metrics.csv stops at ``last_logged`` (default: before the diverged step)."""
    checkpoints = run / "checkpoints"
    assert ckpt.latest_checkpoint(checkpoints).name == f"step-{last_good:08d}"
    kept = [p.name for p in ckpt.list_checkpoints(checkpoints)]
    assert kept == [f"step-{s:08d}" for s in (last_good - 1, last_good)]
    for name in kept:
        assert all(torch.isfinite(t).all() for t in load_file(str(checkpoints / name / ckpt.MODEL_FILE)).values())
    with open(run / "metrics.csv", newline="") as handle:
        assert max(int(row["step"]) for row in csv.DictReader(handle)) == (last_logged or last_good)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_nan_loss_stops_at_its_step(tmp_path, bf16):
    exc, run = sabotaged_run(tmp_path, at=5, what="loss", bf16=bf16)
    assert exc.step == 5
    assert re.search(r"^training diverged at step 5 \(loss nan, gradient norm nan\); nothing was saved "
                     r"after it: the latest checkpoint is still step-00000004 in .*checkpoints\. Start again "
                     r"with a lower --lr$", str(exc))
    assert_good_checkpoints_kept(run, last_good=4)


def test_infinite_gradient_with_a_finite_loss_stops_when_clipping(tmp_path):
    exc, run = sabotaged_run(tmp_path, at=5, what="grad", clip_grad_norm=1.0)
    assert re.search(r"diverged at step 5 \(loss \d+\.\d+, gradient norm (nan|inf)\)", str(exc)), str(exc)
    assert_good_checkpoints_kept(run, last_good=4)


def test_infinite_gradient_without_clipping_is_caught_before_the_save(tmp_path):
    """Without clipping the gradient norm is not computed; the weights the bad step wrote are
    checked before the checkpoint that would save them."""
    exc, run = sabotaged_run(tmp_path, at=5, what="grad", clip_grad_norm=None)
    assert "diverged at step 5 (the weights hold NaN or infinite values)" in str(exc)
    assert "or clip gradients with --clip-grad-norm" in str(exc)
    # Step 5's loss was finite (its gradient was not) and is logged; its weights are not saved.
    assert_good_checkpoints_kept(run, last_good=4, last_logged=5)


def test_cli_huge_lr_exits_1_naming_the_step(tmp_path, run_aiayn, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("recipe.yaml").write_text(RECIPE)
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--lr", "1e30",
                         "--max-steps", "6", "--save-every", "1", "--eval-every", "1000", "--no-progress")
    assert code == 1
    found = re.fullmatch(r"Error: training diverged at step (\d+) \(loss (nan|inf), gradient norm (nan|inf)\); "
                         r"nothing was saved after it: the latest checkpoint is still step-(\d+) in "
                         r"run/checkpoints\. Start again with a lower --lr\n", err)
    assert found, err
    step, latest = int(found[1]), int(found[4])
    assert latest == step - 1
    assert [p.name for p in ckpt.list_checkpoints(Path("run/checkpoints"))][-1] == f"step-{latest:08d}"
    assert ckpt.latest_checkpoint(Path("run/checkpoints")).name == f"step-{latest:08d}"


def test_divergence_of_a_replacement_leaves_the_old_run(tmp_path, run_aiayn, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("recipe.yaml").write_text(RECIPE)
    fast = ["--max-steps", "4", "--save-every", "2", "--eval-every", "1000", "--no-progress"]
    code, _, _ = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", *fast)
    assert code == 0
    before = snapshot(tmp_path)
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--overwrite",
                         "--lr", "1e30", *fast)
    assert code == 1
    assert re.search(r"training diverged at step \d \(loss .*\); no checkpoint had been saved, and the run "
                     r"it was to replace, .*run, is untouched", err), err
    assert snapshot(tmp_path) == before  # no temporary sibling left, the old run as it was
    assert json.loads(Path("run/config.json").read_text())["train"]["lr"] == 3e-3


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--lr", "nan", "'nan' is not a finite number"),
    ("--lr", "inf", "'inf' is not a finite number"),
    ("--lr", "1e999", "'1e999' is not a finite number"),
    ("--lr", "-inf", "-inf is not in the range x>0"),
    ("--weight-decay", "nan", "'nan' is not a finite number"),
    ("--clip-grad-norm", "inf", "'inf' is not a finite number"),
    ("--label-smoothing", "nan", "'nan' is not a finite number"),
    ("--dropout", "nan", "'nan' is not a finite number"),
    ("--attention-dropout", "NaN", "'NaN' is not a finite number"),
    ("--seed", str(2**70), f"{2**70} is not in the range 0<=x<=4294967295"),
    ("--seed", "-1", "-1 is not in the range 0<=x<=4294967295"),
])
def test_non_finite_and_out_of_range_options_are_usage_errors(tmp_path, run_aiayn, monkeypatch, option, value,
                                                              message):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_aiayn("train", option, value, "--max-steps", "1", "--no-progress")
    assert code == 2
    assert f"Error: Invalid value for '{option}': {message}" in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_the_guard_read_once_per_row_still_names_the_first_bad_step(tmp_path):
    """The loss and gradient norm are watched on the device and read with the metrics (every 3
    steps here) or before a save (every 2): the error names step 5, where the loss became NaN, not
    the step at which it was read, and the checkpoint of step 4 stays the latest."""
    exc, run = sabotaged_run(tmp_path, at=5, what="loss", log_every=3, save_every=2)
    assert exc.step == 5
    assert "diverged at step 5 (loss nan, gradient norm nan)" in str(exc)
    checkpoints = run / "checkpoints"
    assert ckpt.latest_checkpoint(checkpoints).name == "step-00000004"
    assert [p.name for p in ckpt.list_checkpoints(checkpoints)] == ["step-00000002", "step-00000004"]
    with open(run / "metrics.csv", newline="") as handle:
        assert [int(row["step"]) for row in csv.DictReader(handle)] == [3]
