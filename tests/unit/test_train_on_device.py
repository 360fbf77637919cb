"""Training's device policy: where the pieces go, what a checkpoint keeps, resume on the device and
across devices, and the one-line refusal of a device this machine lacks. The tests that take the
``device`` fixture run on each of ``AIAYN_TEST_DEVICES`` (CI: the CPU; scripts/gpu-check.sh: CUDA)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn import device as devices
from aiayn.cli import main
from aiayn.config import TrainConfig
from aiayn.train.optim import load_optimizer_state, make_optimizer


def test_resolve_names_devices_and_refuses_absent_ones() -> None:
    assert devices.resolve("cpu") == torch.device("cpu")
    assert devices.resolve(" CPU ") == torch.device("cpu")
    assert devices.resolve("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    assert devices.resolve(None) == devices.resolve("auto")
    if not torch.cuda.is_available():
        with pytest.raises(devices.DeviceError, match="no CUDA GPU"):
            devices.resolve("cuda:1")
    with pytest.raises(devices.DeviceError, match="is not a device"):
        devices.resolve("banana")


def test_precision_policy_per_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert devices.autocast_dtype(cpu) is None and devices.autocast_dtype(cpu, bf16=False) is None
    assert devices.autocast_dtype(cpu, bf16=True) is torch.bfloat16
    assert devices.autocast_dtype(cuda) is torch.bfloat16 and devices.autocast_dtype(cuda, bf16=True) is torch.bfloat16
    assert devices.autocast_dtype(cuda, bf16=False) is None
    assert devices.fused_optimizer(cuda) and not devices.fused_optimizer(cpu)
    assert devices.distributed_backend(cuda) == "nccl" and devices.distributed_backend(cpu) == "gloo"


def test_to_device_keeps_structure_and_leaves_cpu_tensors_alone() -> None:
    batch = {"src": torch.arange(6).view(2, 3), "pair": (torch.ones(2), [torch.zeros(1)]), "n": 3}
    moved = devices.to_device(batch, torch.device("cpu"))
    assert moved["src"] is batch["src"] and moved["pair"][0] is batch["pair"][0]
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list) and moved["n"] == 3


def test_bf16_defaults_to_the_device_and_round_trips() -> None:
    assert TrainConfig().bf16 is None
    assert TrainConfig.from_dict(TrainConfig(bf16=True).to_dict()).bf16 is True
    assert TrainConfig.from_dict({**TrainConfig().to_dict(), "bf16": False}).bf16 is False


def test_optimizer_state_from_another_implementation_keeps_this_ones() -> None:
    """A checkpoint written by fused Adam (a CUDA run) resumes with the CPU's implementation and
    the same moments, and back."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    fused = make_optimizer(model, TrainConfig(optimizer="adamw"), fused=True)
    model(torch.randn(5, 4)).sum().backward()
    fused.step()
    saved = fused.state_dict()
    assert saved["param_groups"][0]["fused"] is True
    plain = make_optimizer(model, TrainConfig(optimizer="adamw"))
    load_optimizer_state(plain, saved)
    assert not plain.param_groups[0]["fused"]
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(plain.state[model.weight][name], fused.state[model.weight][name])
    back = make_optimizer(model, TrainConfig(optimizer="adamw"), fused=True)
    load_optimizer_state(back, plain.state_dict())
    assert back.param_groups[0]["fused"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("args", [
    ["train", "--max-steps", "1"],
    ["experiment", "length-extrapolation"],
    ["explain", "additive", "--quick"],
])
@pytest.mark.parametrize("name", ["cuda", "cuda:3", "banana"])
def test_an_absent_device_is_one_line_and_exit_2(args, name, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--device", name])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("Error: --device ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert ("no CUDA GPU" in err) if name.startswith("cuda") else ("is not a device" in err)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize("task_name", ["reverse", "copy", "set-anomaly"])
def test_a_task_run_trains_evaluates_and_draws_attention_on_the_device(task_name, device, tmp_path) -> None:
    """The trainer on ``device`` (AIAYN_TEST_DEVICES): weights end there, the evaluation and the
    attention example (inputs moved by ``Task.on_model``, maps back on the CPU) run there."""
    from aiayn.tasks.base import get_task
    from aiayn.train.trainer import train

    task = get_task(task_name, n_train=64, n_val=16, n_test=16)
    cfg = TrainConfig(**{**task.train_overrides(), "max_steps": 2, "batch_size": 16, "eval_every": 1000,
                         "average_last": 0})
    result = train(task, task.model_config(), cfg, tmp_path / "run", progress=False, make_plots=False,
                   echo=lambda _: None, device=device)
    assert result.step == 2 and all(v == v for v in result.test_metrics.values())  # finite, not NaN
    model = task.build_model(task.model_config()).to(device)
    example = task.attention_example(model)
    assert example is not None and all(w.device.type == "cpu" for w in example.weights)


def _reverse_run(run_dir: Path, device: torch.device | str, *, steps: int, resume: bool = False) -> int:
    """``steps`` steps of the reverse task, with dropout (so the device's generator matters), a
    checkpoint every 2 steps; returns the step reached."""
    from aiayn.tasks.base import get_task
    from aiayn.train.trainer import train

    task = get_task("reverse", n_train=64, n_val=16, n_test=16)
    model_config = dataclasses.replace(task.model_config(), dropout=0.2)
    cfg = TrainConfig(**{**task.train_overrides(), "max_steps": steps, "batch_size": 16, "eval_every": 1000,
                         "save_every": 2, "average_last": 0})
    return train(task, model_config, cfg, run_dir, resume=resume, progress=False, make_plots=False,
                 echo=lambda _: None, device=device).step


def _back_to_step(run: Path, copy: Path, step: int) -> None:
    """A copy of ``run`` whose checkpoints end at ``step`` (the later ones removed), to resume from."""
    shutil.copytree(run, copy)
    for later in (copy / "checkpoints").glob("step-*"):
        if int(later.name.removeprefix("step-")) > step:
            shutil.rmtree(later)


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors")


def test_a_run_resumed_on_its_device_ends_on_the_straight_runs_weights(device, tmp_path) -> None:
    """4 steps straight against 2, then a resume for the last 2, on ``device``: the same weights
    (with dropout, so the CPU's and the device's generator states are restored from the checkpoint)."""
    assert _reverse_run(tmp_path / "straight", device, steps=4) == 4
    _back_to_step(tmp_path / "straight", tmp_path / "resumed", 2)
    assert _reverse_run(tmp_path / "resumed", device, steps=4, resume=True) == 4
    straight, resumed = _weights(tmp_path / "straight", 4), _weights(tmp_path / "resumed", 4)
    assert straight.keys() == resumed.keys()
    for key in straight:
        if device.type == "cpu":
            assert torch.equal(straight[key], resumed[key]), key
        else:  # a GPU's backward kernels may add in a different order from call to call (atomics);
            # a dropout mask drawn from an unrestored generator would differ far beyond this
            torch.testing.assert_close(resumed[key], straight[key], msg=key)


def test_a_run_moves_from_the_device_to_the_cpu_and_back(device, tmp_path) -> None:
    """Checkpoints carry no device: a run saved on ``device`` resumes on the CPU, and a run saved on
    the CPU resumes on ``device`` (on the CPU alone both are the same-device case above)."""
    cpu = torch.device("cpu")
    for first, then, name in ((device, cpu, "device-then-cpu"), (cpu, device, "cpu-then-device")):
        run = tmp_path / name
        assert _reverse_run(run, first, steps=4) == 4
        _back_to_step(run, tmp_path / f"{name}-resumed", 2)
        assert _reverse_run(tmp_path / f"{name}-resumed", then, steps=4, resume=True) == 4
        for key, tensor in _weights(tmp_path / f"{name}-resumed", 4).items():
            assert tensor.device.type == "cpu" and torch.isfinite(tensor).all(), key


def test_a_resumed_run_counts_its_training_time_from_the_checkpoint(tmp_path) -> None:
    """summary.json's "seconds" and metrics.csv's elapsed_s go on from the checkpoint's count (its
    state's elapsed_s) on resume, and the summary says where it resumed; a checkpoint without the
    count (written before it was kept) resumes with the count started anew, and says so (None)."""
    import csv
    import json

    cpu = torch.device("cpu")
    assert _reverse_run(tmp_path / "straight", cpu, steps=4) == 4
    _back_to_step(tmp_path / "straight", tmp_path / "resumed", 2)
    state_file = tmp_path / "resumed" / "checkpoints" / "step-00000002" / "state.json"
    at_checkpoint = json.loads(state_file.read_text())["elapsed_s"]
    assert at_checkpoint > 0
    assert _reverse_run(tmp_path / "resumed", cpu, steps=4, resume=True) == 4
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["resumed"] == {"step": 2, "seconds": at_checkpoint}
    assert summary["seconds"] > at_checkpoint
    with (tmp_path / "resumed" / "metrics.csv").open(newline="") as handle:
        elapsed = [float(row["elapsed_s"]) for row in csv.DictReader(handle) if row["elapsed_s"]]
    assert elapsed == sorted(elapsed) and elapsed[-1] > at_checkpoint

    _back_to_step(tmp_path / "straight", tmp_path / "old", 2)
    old_state = tmp_path / "old" / "checkpoints" / "step-00000002" / "state.json"
    state = json.loads(old_state.read_text())
    del state["elapsed_s"]
    old_state.write_text(json.dumps(state))
    assert _reverse_run(tmp_path / "old", cpu, steps=4, resume=True) == 4
    assert json.loads((tmp_path / "old" / "summary.json").read_text())["resumed"] == {"step": 2, "seconds": None}
