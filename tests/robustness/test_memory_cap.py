"""The memory check at its edge (``aiayn.train.memory``): a job it accepts in a process whose memory is
capped (RLIMIT_DATA, which Linux enforces on every private mapping since 4.7) trains and saves its
checkpoints; one just over the cap is refused before it allocates. Also: where "available" comes from
(MemAvailable, cgroup v2's memory.max, the process's limits), what a checkpoint save adds, frozen
weights (LoRA's base) without gradients or moments, and a 1.4B-parameter model refused in 24 GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from torch import nn

from aiayn.config import ModelConfig, TrainConfig
from aiayn.models import build_model, size
from aiayn.train import memory
from aiayn.train.checkpoint import save_checkpoint
from aiayn.train.optim import make_optimizer
from aiayn.train.task import Task

GiB, MiB = 2**30, 2**20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA and /proc are Linux's")

# The child: estimate the reverse task's job with no cap, cap its private data at FACTOR times what the
# check allows for (measured from the data it has mapped now, its 2 threads started), then train 2 steps,
# saving after each.
CHILD = """
import json, resource, sys
from pathlib import Path
import torch
from aiayn.config import TrainConfig
from aiayn.tasks.reverse import ReverseTask
from aiayn.train import memory, trainer

factor, run_dir = float(sys.argv[1]), Path(sys.argv[2])
task = ReverseTask(n_train=256, n_val=16, n_test=16)
task.prepare(0)
config = task.model_config().replace(d_model=128, n_heads=4, n_layers=2, d_ff=512)
cfg = TrainConfig(**{**task.train_overrides(), "max_steps": 2, "save_every": 1, "eval_every": 1000,
                     "warmup_steps": 1})
cpu = torch.device("cpu")
estimate = memory.check_training_memory(task, config, cfg, cpu, fast=True)
torch.randn(256, 256) @ torch.randn(256, 256)  # the thread pool's stacks are mapped before the cap
status = lambda: dict(line.split(":", 1) for line in open("/proc/self/status"))
kib = lambda key: int(status()[key].split()[0]) * 1024
cap = kib("VmData") + int(factor * memory.needed_bytes(estimate, cpu))
resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))
open("/proc/self/clear_refs", "w").write("5")  # the resident peak starts again here
rss, said = kib("VmRSS"), []
try:
    step = trainer.train(task, config, cfg, run_dir, progress=False, make_plots=False, echo=said.append).step
    error = None
except Exception as exc:
    step, error = None, f"{type(exc).__name__}: {exc}"
print(json.dumps({"step": step, "error": error, "said": said, "activations": estimate.activations,
                  "grew": kib("VmHWM") - rss}))
"""


def capped_run(factor: float, run_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(factor), str(run_dir)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@linux_only
def test_a_job_accepted_at_its_cap_trains_and_one_just_over_is_refused(tmp_path):
    """1% more than the check allows for: warned, then 2 steps and 2 checkpoints; 1% less: refused with the
    cap's numbers, the run directory never made, no step's memory allocated."""
    accepted = capped_run(1.01, tmp_path / "accepted")
    assert accepted["error"] is None and accepted["step"] == 2, accepted
    assert [line for line in accepted["said"] if "close to the" in line and "RLIMIT_DATA" in line], accepted
    assert sorted(p.name for p in (tmp_path / "accepted" / "checkpoints").glob("step-*")) == [
        "step-00000001", "step-00000002"]
    refused = capped_run(0.99, tmp_path / "refused")
    assert refused["error"].startswith("TrainingMemoryError: training would need about "), refused
    assert "25% margin and the process's own 128 MiB, more than the " in refused["error"]
    assert "left under this process's RLIMIT_DATA; try " in refused["error"]
    assert not (tmp_path / "refused").exists()
    assert refused["grew"] < refused["activations"] // 2, refused


class Windows(Task):
    """Batches of ``b`` windows of ``t`` characters, as shakespeare-char's, without its corpus."""

    def __init__(self, b: int, t: int) -> None:
        super().__init__()
        self.splits = {"train": {"tokens": torch.zeros(4 * b, t, dtype=torch.long),
                                 "targets": torch.zeros(4 * b, t, dtype=torch.long)}}


def test_the_1_4b_parameter_example_is_refused_in_24_gib(monkeypatch):
    """``aiayn train --task shakespeare-char --d-model 2048 --n-layers 28 --n-heads 16 --d-ff 8192``: 1.41B
    parameters whose weights, gradients and Adam alone take about 21 GiB; counted on the meta device."""
    config = ModelConfig(arch="decoder-only", vocab_size=65, d_model=2048, n_heads=16, n_layers=28, d_ff=8192,
                         activation="gelu", norm_position="pre", positional="learned", scale_embeddings=False,
                         max_seq_len=64, pad_id=None, dropout=0.0)
    train = TrainConfig(batch_size=12, optimizer="adamw", weight_decay=0.1)
    for module in (memory, size):
        monkeypatch.setattr(module, "available_memory", lambda: 24 * GiB)
    monkeypatch.setattr(memory, "cgroup_room", lambda: None)
    monkeypatch.setattr(memory, "rlimit_rooms", lambda: iter(()))
    with pytest.raises(memory.TrainingMemoryError) as refused:
        memory.check_training_memory(Windows(12, 64), config, train, torch.device("cpu"), fast=True)
    message = str(refused.value)
    assert message.startswith("training would need about 21.") and "GiB (weights 5.25 GiB" in message, message
    assert " for batches of 12 x 64 tokens, up to 28." in message, message
    assert message.endswith("more than the 24 GiB available here; try a smaller model"), message


def test_frozen_weights_have_no_gradients_or_moments():
    """LoRA's shape: a frozen base plus small trainable adapters, attached by ``adapt`` to a meta copy,
    so a task's model that is kept (a loaded starting point) is left as it was."""
    config = ModelConfig(arch="decoder-only", vocab_size=512, d_model=64, n_heads=4, n_layers=2, d_ff=256,
                         max_seq_len=32, pad_id=None)
    kept = build_model(config)

    class Loaded(Windows):
        def build_model(self, config: ModelConfig) -> nn.Module:
            return kept

    def adapt(model: nn.Module) -> None:
        model.requires_grad_(False)
        model.adapter = nn.Linear(64, 8, bias=False)  # 512 values, trainable

    counts = memory.model_counts(Loaded(2, 8), config, adapt=adapt)
    whole = memory.model_counts(None, config)
    assert counts.trainable == 4 * 512 and counts.frozen and not whole.frozen
    assert counts.weights == whole.weights + 4 * 512
    estimate = memory.estimate_training_memory(config, memory.BatchShape(2, 8), memory.Execution(), counts=counts)
    assert estimate.gradients == 4 * 512 and estimate.optimizer == 2 * 4 * 512
    assert all(p.device.type == "cpu" and p.requires_grad for p in kept.parameters())
    assert not hasattr(kept, "adapter")


def test_a_copying_safetensors_counts_the_larger_file(monkeypatch):
    """A safetensors that copies each file's tensors into bytes (no zero-copy ``TensorSpec``) holds the
    larger of the weights (only the trainable ones when some are frozen) and Adam's moments besides them."""
    counts = memory.ModelCounts(weights=1000, trainable=400, matmul=0, largest=80, fused_head=False,
                                largest_weight=200, frozen=True)
    cpu, cuda = memory.Execution(), memory.Execution(device_type="cuda")
    mask = 200 // memory.F32
    if hasattr(safetensors, "TensorSpec"):
        assert memory.checkpoint_bytes(counts, cpu) == mask
        monkeypatch.delattr(safetensors, "TensorSpec")
    assert memory.checkpoint_bytes(counts, cpu) == mask + 2 * 400
    assert memory.checkpoint_bytes(counts, cuda) == mask  # copied to the host, not on the GPU
    assert memory.checkpoint_bytes(memory.ModelCounts(1000, 1000, 0, 80, False, 200), cpu) == mask + 2000


def vm(key: str) -> int:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status[key].split()[0]) * 1024


@linux_only
def test_a_checkpoint_save_adds_no_more_than_counted(tmp_path):
    """The resident peak of a save (weights and moments already there) grows by what ``checkpoint_bytes``
    counts, and a few MiB of Python objects and file buffers."""
    config = ModelConfig(arch="decoder-only", vocab_size=8000, d_model=256, n_heads=4, n_layers=2, d_ff=1024,
                         max_seq_len=32, pad_id=None)
    model = build_model(config)
    optimizer = make_optimizer(model, TrainConfig(optimizer="adamw"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    counts = memory.model_counts(None, config)
    Path("/proc/self/clear_refs").write_text("5")  # the resident peak starts again from here
    before = vm("VmRSS")
    save_checkpoint(tmp_path, step=1, model=model, optimizer=optimizer, state={})
    grew = vm("VmHWM") - before
    assert grew <= memory.checkpoint_bytes(counts, memory.Execution()) + 4 * MiB, grew / MiB


def test_available_is_the_least_of_the_machine_its_cgroup_and_its_limits(tmp_path, monkeypatch):
    """cgroup v2: each group from ours up to the root, its memory.max less what it holds (inactive page
    cache counted free); the least room wins, and the least of all sources is the check's."""
    group = tmp_path / "machine.slice" / "job"
    group.mkdir(parents=True)
    for where, limit, used, cache in ((group, "max", 10, 0), (group.parent, str(3 * GiB), 2 * GiB, GiB // 2)):
        (where / "memory.max").write_text(limit + "\n")
        (where / "memory.current").write_text(f"{used}\n")
        (where / "memory.stat").write_text(f"anon {used}\ninactive_file {cache}\n")
    (tmp_path / "cgroup").write_text("0::/machine.slice/job\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "cgroup")
    monkeypatch.setattr(memory, "rlimit_rooms", lambda: iter(()))
    assert memory.cgroup_room() == 3 * GiB // 2
    monkeypatch.setattr(memory, "available_memory", lambda: 8 * GiB)
    cpu = torch.device("cpu")
    assert memory.available_bytes(cpu) == (3 * GiB // 2, "left under this cgroup's memory.max")
    assert memory.available_bytes(cpu, local_processes=2) == (
        3 * GiB // 4, "left to each of this machine's 2 processes under this cgroup's memory.max")
    monkeypatch.setattr(memory, "rlimit_rooms", lambda: iter([(GiB, "left under this process's RLIMIT_AS")]))
    assert memory.available_bytes(cpu) == (GiB, "left under this process's RLIMIT_AS")
    monkeypatch.setattr(memory, "available_memory", lambda: GiB // 2)
    assert memory.available_bytes(cpu) == (GiB // 2, "available here")
