"""Training really learns, resumes exactly, and never loses a checkpoint."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn.config import TrainConfig
from aiayn.tasks import get_task
from aiayn.train import checkpoint as ckpt
from aiayn.train.trainer import train


def test_reverse_is_learned(tmp_path):
    """A small, fast reverse run reaches near-perfect sequence accuracy on unseen test sequences."""
    task = get_task("reverse", n_train=12_000, n_val=500, n_test=2_000)
    cfg = TrainConfig(**{**task.train_overrides(), "epochs": 4, "batch_size": 64})
    result = train(task, task.model_config(), cfg, tmp_path / "run", progress=False, make_plots=False)
    assert result.test_metrics["acc"] >= 0.999
    assert result.test_metrics["seq_acc"] >= 0.99


@pytest.mark.slow
def test_copy_is_learned_with_cached_greedy_decoding(tmp_path):
    task = get_task("copy", n_train=20_000, n_val=500, n_test=2_000)
    cfg = TrainConfig(**{**task.train_overrides(), "epochs": 3})
    result = train(task, task.model_config(), cfg, tmp_path / "run", progress=False, make_plots=False)
    assert result.test_metrics["greedy_exact"] >= 0.99


# Checkpoints every 15 steps, metrics rows every 10: the run is killed with a half-filled row pending.
RESUME_ARGS = ["--task", "reverse", "--max-steps", "60", "--save-every", "15", "--eval-every", "1000",
               "--dropout", "0.1", "--batch-size", "64", "--no-progress"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None and latest.name == "step-00000060"
    return load_file(str(latest / ckpt.MODEL_FILE))


def untimed_rows(metrics_csv: Path) -> list[dict[str, str]]:
    with open(metrics_csv, newline="", encoding="utf-8") as handle:
        return [{k: v for k, v in row.items() if k not in ("tokens_per_s", "elapsed_s")}
                for row in csv.DictReader(handle)]


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path, run_aiayn_process):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_aiayn_process("train", "--run-dir", str(straight), *RESUME_ARGS)
    assert result.returncode == 0, result.stderr

    proc = subprocess.Popen([sys.executable, "-m", "aiayn", "train", "--run-dir", str(killed), *RESUME_ARGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step-00000045").is_dir():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = ckpt.latest_checkpoint(killed / "checkpoints")
    assert saved is not None and saved.name < "step-00000060"

    resumed = run_aiayn_process("train", "--run-dir", str(killed), "--resume", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout

    a, b = final_weights(straight), final_weights(killed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    summary_a = json.loads((straight / "summary.json").read_text())
    summary_b = json.loads((killed / "summary.json").read_text())
    assert summary_a["final_train_loss"] == summary_b["final_train_loss"]
    assert summary_a["test"] == summary_b["test"]
    # metrics.csv too, row for row, but for the timing columns (the row after the resumed checkpoint
    # included: the checkpoint saves the statistics of its half-filled window)
    rows_a, rows_b = (untimed_rows(run / "metrics.csv") for run in (straight, killed))
    assert len(rows_a) == 7 and rows_a == rows_b  # 6 training rows, the final validation


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    task = get_task("reverse", n_train=640, n_val=64, n_test=64)
    model = task.build_model(task.model_config())
    directory = tmp_path / "checkpoints"
    ckpt.save_checkpoint(directory, step=1, model=model, optimizer=None, state={"epoch": 0, "batch_in_epoch": 1})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing optimizer.safetensors")

    monkeypatch.setattr(ckpt, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(directory, step=2, model=model, optimizer=None, state={"epoch": 0, "batch_in_epoch": 2})
    monkeypatch.undo()
    latest = ckpt.latest_checkpoint(directory)
    assert latest is not None and latest.name == "step-00000001"
    fresh = task.build_model(task.model_config())
    loaded = ckpt.load_checkpoint(latest, fresh)
    assert loaded.step == 1
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, before[key])


def test_truncated_checkpoint_gives_a_clear_error(tmp_path):
    task = get_task("reverse", n_train=640, n_val=64, n_test=64)
    model = task.build_model(task.model_config())
    directory = tmp_path / "checkpoints"
    for step in (1, 2):
        ckpt.save_checkpoint(directory, step=step, model=model, optimizer=None, state={"epoch": 0, "batch_in_epoch": 0})
    weights = directory / "step-00000002" / ckpt.MODEL_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match=r"corrupt or truncated .* earlier checkpoints .*step-00000001"):
        ckpt.load_checkpoint(directory / "step-00000002", model)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    task = get_task("reverse", n_train=640, n_val=64, n_test=64)
    model = task.build_model(task.model_config())
    ckpt.save_checkpoint(tmp_path, step=1, model=model, optimizer=None, state={"epoch": 0, "batch_in_epoch": 0})
    other = task.build_model(task.model_config().replace(d_model=48))
    with pytest.raises(ckpt.CheckpointError, match="does not fit this model"):
        ckpt.load_checkpoint(tmp_path / "step-00000001", other)


def test_optimizer_state_round_trips(tmp_path):
    task = get_task("reverse", n_train=640, n_val=64, n_test=64)
    task.prepare(0)
    model = task.build_model(task.model_config())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    logits, targets = task.forward(model, task.collate("train", torch.arange(8)))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    opt.step()
    ckpt.save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, state={"epoch": 0, "batch_in_epoch": 0})
    loaded = ckpt.load_checkpoint(tmp_path / "step-00000001", model)
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    fresh.load_state_dict(loaded.optimizer_state)
    assert len(opt.state) > 0 and fresh.state.keys() == opt.state.keys()
    for p in opt.state:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[p][name], opt.state[p][name])


# ---- the command line: errors are one line, exit code 2, nothing saved is lost -----------------
FAST = ["--max-steps", "4", "--save-every", "2", "--eval-every", "1000", "--no-progress"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--task", "nope"], "unknown task 'nope'; known tasks: chat, copy"),
        (["--lr", "0"], "Invalid value for '--lr'"),
        (["--batch-size", "-3"], "Invalid value for '--batch-size'"),
        (["--epochs", "0"], "Invalid value for '--epochs'"),
        (["--resume"], "--resume needs --run-dir"),
        (["--d-model", "30", "--n-heads", "4"], "d_model=30 is not divisible by n_heads=4"),
    ],
)
def test_train_cli_bad_arguments(run_aiayn, args, needle):
    code, out, err = run_aiayn("train", *args, "--no-progress")  # run_aiayn fails the test on a traceback
    assert code == 2, out + err
    assert needle in err


@pytest.mark.slow
def test_train_cli_run_dir_rules(tmp_path, run_aiayn, run_aiayn_process):
    """The run in a child process (the real command), the refusals after it in this process."""
    run = tmp_path / "run"
    first = run_aiayn_process("train", "--run-dir", str(run), "--padding-free", *FAST)
    assert first.returncode == 0, first.stderr
    assert json.loads((run / "config.json").read_text())["model"]["padding_free"] is True
    assert "Test split" in first.stdout and "examples" in first.stdout
    for name in ("config.json", "metrics.csv", "summary.json", "curves.png", "attention.png"):
        assert (run / name).is_file(), name
    weights_before = (ckpt.latest_checkpoint(run / "checkpoints") / ckpt.MODEL_FILE).read_bytes()

    code, _, err = run_aiayn("train", "--run-dir", str(run), *FAST)
    assert code == 2 and "already exists; pass --resume" in err

    code, _, err = run_aiayn("train", "--run-dir", str(run), "--resume", "--lr", "0.5", "--d-model", "64", *FAST)
    assert code == 2
    assert "differs from the one given in 2 field(s)" in err
    assert "train.lr: 0.003 -> 0.5" in err and "model.d_model: 32 -> 64" in err

    latest = ckpt.latest_checkpoint(run / "checkpoints")
    (latest / ckpt.STATE_FILE).write_text("{truncated", encoding="utf-8")
    code, _, err = run_aiayn("train", "--run-dir", str(run), "--resume", "--no-progress")  # no traceback either
    assert code == 2 and "corrupt or truncated" in err
    # nothing already saved was lost
    assert (latest / ckpt.MODEL_FILE).read_bytes() == weights_before


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, run_aiayn):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "aiayn", "train", "--run-dir", str(run), "--task", "reverse",
                             "--max-steps", "100000", "--save-every", "50", "--eval-every", "100000",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "step-00000050").is_dir():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "interrupted at step" in stdout and "aiayn train --resume" in stdout
    latest = ckpt.latest_checkpoint(run / "checkpoints")
    step = int(latest.name.split("-")[1])
    assert step >= 50  # saved at the step it was interrupted
    assert json.loads((latest / ckpt.STATE_FILE).read_text())["step"] == step
    code, out, err = run_aiayn("train", "--run-dir", str(run), "--resume", "--max-steps", str(step + 5), "--no-progress")
    assert code == 0, err
    assert f"(step {step}," in out


def test_bf16_autocast_trains(tmp_path):
    task = get_task("reverse", n_train=640, n_val=64, n_test=64)
    cfg = TrainConfig(**{**task.train_overrides(), "max_steps": 10, "bf16": True})
    result = train(task, task.model_config(), cfg, tmp_path / "run", progress=False, make_plots=False)
    assert result.step == 10 and 0 < result.final_loss < 10


def test_average_last_scores_the_mean_of_the_last_checkpoints(tmp_path):
    """average_last=N: the mean weights of the last N checkpoints are saved as RUN/averaged-lastN,
    val is scored again for them in summary.json, and the test split is scored with the better on val."""
    task = get_task("reverse", n_train=2_000, n_val=200, n_test=200)
    cfg = TrainConfig(**{**task.train_overrides(), "max_steps": 30, "save_every": 10, "eval_every": 1000,
                         "batch_size": 64, "keep_checkpoints": 3, "average_last": 3})
    run_dir = tmp_path / "run"
    result = train(task, task.model_config(), cfg, run_dir, progress=False, make_plots=False)
    kept = ckpt.list_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in kept] == ["step-00000010", "step-00000020", "step-00000030"]
    weights = [load_file(str(p / ckpt.MODEL_FILE)) for p in kept]
    averaged_dir = ckpt.latest_checkpoint(run_dir / "averaged-last3")
    assert averaged_dir is not None
    averaged = load_file(str(averaged_dir / ckpt.MODEL_FILE))
    assert averaged.keys() == weights[0].keys()
    for key, value in averaged.items():
        expected = (sum(w[key].double() for w in weights) / 3).float()
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-7)
        assert not torch.equal(value, weights[-1][key]) or torch.equal(weights[0][key], weights[-1][key])

    # The summary's test metrics are those of the weights better on val, the averaged or the last
    # (tests/integration/test_short_runs.py makes each win).
    summary = json.loads((run_dir / "summary.json").read_text())
    model = task.build_model(task.model_config())
    ckpt.load_checkpoint(averaged_dir if summary["test_checkpoint"]["used"] == "averaged" else kept[-1], model)
    assert task.evaluate(model.eval(), "test") == pytest.approx(result.test_metrics)
    assert summary["averaged"]["checkpoints_averaged"] == 3
    assert set(summary["averaged"]["val"]) >= {"nll", "acc"}


def test_average_last_needs_enough_kept_checkpoints():
    with pytest.raises(ValueError, match="keep_checkpoints"):
        TrainConfig(average_last=5, keep_checkpoints=3)


def test_resume_a_run_saved_before_newer_config_fields(tmp_path):
    """A run whose config.json predates a field (here average_last) resumes: the field takes its
    default, and average_last may be changed on resume (it only acts after the last step)."""
    task = get_task("reverse", n_train=1_000, n_val=100, n_test=100)
    cfg = TrainConfig(**{**task.train_overrides(), "max_steps": 10, "batch_size": 64, "eval_every": 1000})
    run_dir = tmp_path / "run"
    train(task, task.model_config(), cfg, run_dir, progress=False, make_plots=False)
    config_path = run_dir / "config.json"
    saved = json.loads(config_path.read_text())
    del saved["train"]["average_last"]
    config_path.write_text(json.dumps(saved))
    longer = cfg.replace(max_steps=20, average_last=2)
    result = train(task, task.model_config(), longer, run_dir, resume=True, progress=False, make_plots=False)
    assert result.step == 20
    assert (run_dir / "averaged-last2").is_dir()
