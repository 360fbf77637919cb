"""Honest short runs: a warm-up longer than the run, or averaging fewer checkpoints
than asked, is a one-line warning with the numbers; the averaged folder is named for the K
checkpoints it holds (one is not averaged at all), as in ``aiayn average``; and the test split is
scored with the better of the last and the averaged weights on val, recorded in summary.json and
the summary line. Tiny reverse runs, seconds each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from aiayn.cli.train import _report
from aiayn.config import TrainConfig
from aiayn.tasks import get_task
from aiayn.train import checkpoint as ckpt
from aiayn.train.averaging import plan_average
from aiayn.train.optim import warmup_warning
from aiayn.train.trainer import TrainResult, train

SIZES = {"n_train": 640, "n_val": 64, "n_test": 64}  # 10 steps an epoch at batch 64


def config(task: Any, **changes: Any) -> TrainConfig:
    return TrainConfig(**{**task.train_overrides(), "batch_size": 64, "eval_every": 1000, "warmup_steps": 2,
                          **changes})


def run(run_dir: Path, *, resume: bool = False, task: Any = None, **changes: Any) -> tuple[TrainResult, list[str]]:
    """A tiny reverse run -> (result, the lines the trainer said)."""
    task = task or get_task("reverse", **SIZES)
    said: list[str] = []
    result = train(task, task.model_config(), config(task, **changes), run_dir, resume=resume, progress=False,
                   make_plots=False, echo=said.append)
    return result, said


# ---- warm-up longer than the run --------------------------------------------------------------
def test_warmup_warning_names_both_numbers_and_the_peak():
    cfg = TrainConfig(lr=3e-3, schedule="cosine", warmup_steps=600)
    line = warmup_warning(cfg, total_steps=150, d_model=128)
    assert line is not None and "\n" not in line
    assert "150 steps are fewer than its 600 warm-up steps" in line
    assert "never reaches its peak 0.003" in line and "--warmup-steps 15" in line
    assert warmup_warning(cfg, total_steps=600, d_model=128) is None  # the peak is the last step
    noam = TrainConfig(lr=1.0, schedule="noam", warmup_steps=4000)
    assert f"peak {128**-0.5 * 4000**-0.5:.3g}" in warmup_warning(noam, total_steps=10, d_model=128)


def test_short_run_warns_once_also_on_resume_and_a_normal_run_does_not(tmp_path):
    _, said = run(tmp_path / "short", max_steps=3, warmup_steps=50)
    warned = [line for line in said if "warm-up" in line]
    assert warned == [line for line in warned if line.startswith("warning: the run's 3 steps are fewer than "
                                                                "its 50 warm-up steps")] and len(warned) == 1
    _, said = run(tmp_path / "short", resume=True, max_steps=5, warmup_steps=50)
    assert len([line for line in said if "warm-up" in line]) == 1 and "run's 5 steps" in " ".join(said)
    _, said = run(tmp_path / "normal", max_steps=3, warmup_steps=2)
    assert not [line for line in said if "warm-up" in line]


# ---- averaging fewer checkpoints than asked ----------------------------------------------------
@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult, list[str]]:
    """30 steps, a checkpoint every 10, keep 5, average_last 5: 3 checkpoints to average."""
    run_dir = tmp_path_factory.mktemp("three") / "run"
    result, said = run(run_dir, max_steps=30, save_every=10, keep_checkpoints=5, average_last=5)
    return run_dir, result, said


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult, list[str]]:
    """10 steps, one checkpoint, average_last 5: nothing to average."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    result, said = run(run_dir, max_steps=10, save_every=10, keep_checkpoints=5, average_last=5)
    return run_dir, result, said


def test_fewer_checkpoints_than_asked_warns_and_names_the_folder_for_them(three):
    run_dir, result, said = three
    expected = (f"warning: asked to average the last 5 checkpoints but {run_dir / 'checkpoints'} keeps 3: "
                f"averaging 3 into averaged-last3")
    assert said.count(expected) == 1
    assert (run_dir / "averaged-last3").is_dir() and not (run_dir / "averaged-last5").exists()
    saved = ckpt.latest_checkpoint(run_dir / "averaged-last3")
    assert json.loads((saved / ckpt.STATE_FILE).read_text())["averaged"] == [
        "step-00000010", "step-00000020", "step-00000030"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["averaged"]["checkpoints_averaged"] == 3 and summary["averaged"]["asked"] == 5
    choice = summary["test_checkpoint"]
    assert choice == result.test_checkpoint and choice["chosen_by"] == "val nll"  # reverse has no BLEU
    val = choice["val"]
    assert choice["used"] == ("averaged" if val["averaged"] < val["last"] else "last")
    assert val["averaged"] == summary["averaged"]["val"]["nll"]


def test_resuming_a_finished_run_scores_its_last_checkpoint_on_val_again(three, tmp_path):
    """No step left to train: the loop never validates, so the choice scores the last checkpoint's
    val itself, and chooses as the run did."""
    run_dir, result, _ = three
    shutil.copytree(run_dir, tmp_path / "run", symlinks=True)
    again, said = run(tmp_path / "run", resume=True, max_steps=30, save_every=10, keep_checkpoints=5,
                      average_last=5)
    assert again.step == 30 and any(line.startswith("resuming") for line in said)
    assert again.test_checkpoint["used"] == result.test_checkpoint["used"]
    assert again.test_checkpoint["val"] == pytest.approx(result.test_checkpoint["val"])


def test_a_single_checkpoint_is_not_averaged(one):
    run_dir, result, said = one
    assert (f"warning: asked to average the last 5 checkpoints but {run_dir / 'checkpoints'} keeps 1: "
            f"nothing to average, step-00000010 stands as it is") in said
    assert not list(run_dir.glob("averaged-*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "averaged" not in summary
    assert summary["test_checkpoint"] == result.test_checkpoint == {"used": "last", "checkpoint": str(run_dir / "checkpoints" / "step-00000010"),
                                          "reason": "nothing to average: 1 checkpoint(s) kept, 5 asked"}


def test_aiayn_average_follows_the_same_rule(three, one, run_aiayn, tmp_path):
    """`aiayn average --last 5` warns as the trainer did (the same line) and writes averaged-last3;
    with one checkpoint it writes nothing and says why; neither refuses."""
    run_dir, _, said = three
    code, out, err = run_aiayn("average", "--run", str(run_dir), "--last", "5", "--out", str(tmp_path / "avg"))
    assert code == 0 and err.strip() in said and "averaging 3 into averaged-last3" in err
    assert "averaged step-00000010, step-00000020, step-00000030 -> " in out
    plan = plan_average(run_dir / "checkpoints", 5)
    assert (plan.count, plan.folder_name, plan.averages) == (3, "averaged-last3", True)
    code, out, err = run_aiayn("average", "--run", str(run_dir), "--last", "2")
    assert code == 0 and not err and (run_dir / "averaged-last2").is_dir()  # as many as asked: no warning

    run_dir, _, said = one
    code, out, err = run_aiayn("average", "--run", str(run_dir), "--last", "5")
    assert code == 0 and not out and err.strip() in said and "nothing to average" in err
    code, out, err = run_aiayn("average", "--run", str(run_dir), "--last", "1")
    assert code == 0 and "averaging the last 1 checkpoint: nothing to average" in err
    assert not list(run_dir.glob("averaged-*"))


# ---- the test split is scored with the better on val --------------------------------------------
def scripted_val_bleu(task: Any, bleus: list[float]) -> list[float]:
    """Give each val evaluation the next of ``bleus`` as its BLEU (the real metrics besides): the
    loop's last validation, then the averaged weights'. Returns what is left of the list."""
    real = task.evaluate

    def evaluate(model: Any, split: str, batch_size: int = 500) -> dict[str, float]:
        metrics = real(model, split, batch_size)
        if split == "val":
            metrics["bleu"] = bleus.pop(0)
        return metrics

    task.evaluate = evaluate
    return bleus


@pytest.mark.parametrize(("last_bleu", "averaged_bleu", "used"), [(20.0, 10.0, "last"), (10.0, 20.0, "averaged")])
def test_test_split_is_scored_with_the_better_on_val(tmp_path, capsys, last_bleu, averaged_bleu, used):
    task = get_task("reverse", **SIZES)
    left = scripted_val_bleu(task, [last_bleu, averaged_bleu])
    run_dir = tmp_path / "run"
    result, _ = run(run_dir, task=task, max_steps=20, save_every=10, keep_checkpoints=3, average_last=2)
    assert left == []  # val scored twice: the loop's last validation is reused for the last checkpoint
    choice = json.loads((run_dir / "summary.json").read_text())["test_checkpoint"]
    assert choice["used"] == used and choice["chosen_by"] == "val bleu"
    assert choice["val"] == {"last": last_bleu, "averaged": averaged_bleu}
    chosen = run_dir / ("averaged-last2" if used == "averaged" else "checkpoints")
    assert Path(choice["checkpoint"]) == ckpt.latest_checkpoint(chosen)

    # The test metrics are those of the chosen weights (scored again here, test split only).
    model = task.build_model(task.model_config())
    ckpt.load_checkpoint(Path(choice["checkpoint"]), model)
    assert task.evaluate(model.eval(), "test") == pytest.approx(result.test_metrics)

    _report(result, run_dir)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("finished"))
    expected = ("the averaged checkpoint averaged-last2, better on val bleu (20 vs 10 for the last)"
                if used == "averaged" else "the last checkpoint, better on val bleu (20 vs 10 averaged)")
    assert f"Test split, scored with {expected}: " in line
