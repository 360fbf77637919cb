"""Memory before training (``aiayn.train.memory``): the estimate of a training step's peak (weights,
gradients, Adam's moments, activations) is within 25% of the peak measured on the CPU, a run whose
step cannot fit is refused before anything is allocated with the numbers and a fix that fits, and
an out-of-memory error during a step is one line that names the checkpoint it left untouched.

The measurement: torch's profiler records every allocation and free of the CPU allocator
(``profile_memory``); their running sum over building the model, its optimizer and two training
steps (the trainer's own ``step_loss``, ``make_optimizer``, ``clip_and_measure``, and aiayn.fast's
kernels where the trainer uses them) peaks where the step does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from aiayn.config import ModelConfig, TrainConfig
from aiayn.models import build_model
from aiayn.tasks.reverse import ReverseTask
from aiayn.train import memory
from aiayn.train.checkpoint import latest_checkpoint
from aiayn.train.losses import IGNORE
from aiayn.train.optim import clip_and_measure, make_optimizer
from aiayn.train.task import Batch, Task
from aiayn.train.trainer import step_loss

RECIPE = "task: reverse\ntask_options: {n_train: 512, n_val: 32, n_test: 32}\n"
QUICK = ["--eval-every", "1000", "--no-progress"]


class Tokens(Task):
    """Random token batches for ``config``'s architecture; with ``padded``, half the rows end in
    padding (a quarter of their positions) with their targets ignored."""

    def __init__(self, config: ModelConfig, b: int, t: int, *, padded: bool = False) -> None:
        super().__init__()
        self.config, self.b, self.t, self.padded = config, b, t, padded

    def batch(self, generator: torch.Generator) -> Batch:
        c, shape = self.config, (self.b, self.t)
        ids = {k: torch.randint(1, c.vocab_size, shape, generator=generator) for k in ("src", "tgt", "targets")}
        if self.padded:
            ids["src"][: self.b // 2, 3 * self.t // 4:] = 0
            ids["tgt"][: self.b // 2, 3 * self.t // 4:] = 0
            ids["targets"][: self.b // 2, 3 * self.t // 4:] = IGNORE
        return ids

    def forward(self, model: nn.Module, batch: Batch) -> tuple[Any, Tensor]:
        if self.config.arch == "encoder-decoder":
            return model(batch["src"], batch["tgt"]), batch["targets"]
        out = model(batch["src"])
        return (out.logits if self.config.arch == "encoder-only" else out), batch["targets"]


def measured_peak(task: Tokens, train: TrainConfig, *, fast: bool, steps: int = 2) -> int:
    """The peak of live CPU tensor bytes over building the model and optimizer and ``steps``
    training steps, as the trainer takes them."""
    generator = torch.Generator().manual_seed(0)
    batches = [task.batch(generator) for _ in range(steps)]
    cpu = torch.device("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_model(task.config)
        if fast:
            from aiayn.fast import optimize

            optimize(model, mode="train")
        optimizer = make_optimizer(model, train)
        for batch in batches:
            model.train()
            loss, *_ = step_loss(task, model, batch, device=cpu, bf16=train.bf16)
            loss.backward()
            clip_and_measure(model.parameters(), train.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


GPT = dict(arch="decoder-only", vocab_size=512, d_model=64, n_heads=4, n_layers=2, d_ff=256, activation="gelu",
           norm_position="pre", positional="learned", max_seq_len=128, pad_id=None)
CASES = {  # name: (model config, batch, positions, padded, fast (aiayn.fast's kernels), bf16)
    # nanoGPT-like, as the trainer runs it on the CPU: block-causal attention, the fused loss
    "gpt-tiny": (GPT, 8, 128, False, True, None),
    # the paper's post-norm encoder-decoder with dropout and padded batches, plain PyTorch
    "encoder-decoder": (dict(arch="encoder-decoder", vocab_size=1000, d_model=64, n_heads=4, n_layers=2,
                             d_ff=256, dropout=0.1, max_seq_len=64, pad_id=0), 16, 32, True, False, None),
    # LLaMA-like (RMSNorm, RoPE, SwiGLU, grouped-query attention) under bfloat16 autocast
    "llama-bf16": ({**GPT, "n_heads": 8, "n_kv_heads": 2, "norm": "rmsnorm", "positional": "rope",
                    "activation": "swiglu", "bias": False}, 8, 64, False, True, True),
    # a large vocabulary and a small batch: the weights, gradients and optimizer dominate
    "weights-bound": ({**GPT, "vocab_size": 8000, "d_model": 128}, 2, 16, False, True, None),
}


@pytest.mark.parametrize("name", CASES)
def test_estimate_is_within_25_percent_of_the_measured_peak(name):
    settings, b, t, padded, fast, bf16 = CASES[name]
    config = ModelConfig(**settings)
    train = TrainConfig(optimizer="adamw", weight_decay=0.1, batch_size=b, bf16=bf16)
    task = Tokens(config, b, t, padded=padded)
    peak = measured_peak(task, train, fast=fast)
    execution = memory.training_execution(torch.device("cpu"), train, fast=fast)
    estimate = memory.estimate_training_memory(config, memory.BatchShape(b, t, t), execution,
                                               counts=memory.model_counts(task, config))
    ratio = estimate.peak / peak
    print(f"{name}: measured {peak / 2**20:.2f} MiB, estimated {estimate.describe()} ({ratio - 1:+.1%})")
    assert 0.75 <= ratio <= 1.25, f"{name}: estimated {estimate.peak:,} bytes, measured {peak:,}"


def test_batch_shape_reads_the_largest_tensors():
    shape = memory.batch_shape({"src": torch.zeros(4, 7), "tgt_in": torch.zeros(4, 9), "n": torch.zeros(4)})
    assert shape == memory.BatchShape(4, 9, 9)


# ---- refused before training --------------------------------------------------------------------
@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    return tmp_path


def test_a_run_that_cannot_fit_is_refused_with_a_fix_that_fits(work, run_aiayn, monkeypatch):
    """Reverse's default batch (128) in a machine with memory for about half its activations once the
    estimate's margin and the process's own are set aside: one line with the numbers (exit 2, nothing
    left behind), whose suggested batch then trains."""
    task = ReverseTask(n_train=512, n_val=32, n_test=32)
    config, train = task.model_config(), TrainConfig(**task.train_overrides())
    needed = memory.estimate_training_memory(config, memory.BatchShape(128, 16, 16),
                                             memory.training_execution(torch.device("cpu"), train, fast=True),
                                             counts=memory.model_counts(task, config))
    fixed = needed.weights + needed.optimizer
    usable = fixed + needed.activations * 6 // 10
    monkeypatch.setattr(memory, "available_memory",
                        lambda: int(usable / (1 - memory.MARGIN)) + memory.PROCESS_OVERHEAD)
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--max-steps", "1", *QUICK)
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"training would need about [\d.]+ [KM]iB \(weights [\d.]+ KiB \+ Adam's moments "
                     r"[\d.]+ KiB \+ the larger of activations [\d.]+ MiB and gradients [\d.]+ KiB\) for batches "
                     r"of 128 x 16 tokens, up to [\d.]+ MiB with the estimate's 25% margin and the process's own "
                     r"128 MiB, more than the [\d.]+ MiB available here; try --batch-size 64 --grad-accum 2, or "
                     r"a smaller model", err), err
    assert not (work / "run").exists()
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--max-steps", "1",
                         "--batch-size", "64", "--grad-accum", "2", *QUICK)
    assert code == 0, err
    assert latest_checkpoint(work / "run" / "checkpoints") is not None


# ---- out of memory during a step ----------------------------------------------------------------
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 78.10 GiB memory in use.")


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size if p.is_file() else 0, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("at", [1, 3])
def test_out_of_memory_in_a_step_is_one_line_and_leaves_the_checkpoints(work, run_aiayn, monkeypatch, at):
    """torch.OutOfMemoryError raised by training step ``at`` (checkpoints are saved every step):
    exit 1, one line with what was asked and free, the checkpoint kept and the fix; the
    checkpoints are as they were when the step began (none yet at step 1: the run is not left)."""
    steps, seen = [0], {}
    forward = ReverseTask.forward

    def running_out(self: ReverseTask, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        if model.training:
            steps[0] += 1
            if steps[0] == at:
                seen["checkpoints"] = snapshot(work / "run" / "checkpoints")
                raise torch.OutOfMemoryError(CUDA_OOM)
        return forward(self, model, batch)

    monkeypatch.setattr(ReverseTask, "forward", running_out)
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--max-steps", "5",
                         "--save-every", "1", *QUICK)
    assert code == 1 and err.count("\n") == 1, err
    assert "Error: out of memory on cpu during training (tried to allocate 2.00 GiB, 1.06 GiB free); " in err
    if at == 1:
        assert seen["checkpoints"] == {} and not (work / "run").exists()
        assert f"no checkpoint had been saved, so {Path('run')} was left as it was before this start" in err
        assert "start again with --batch-size 64 --grad-accum 2 (the same batch per step)" in err
    else:
        assert snapshot(work / "run" / "checkpoints") == seen["checkpoints"]
        assert latest_checkpoint(work / "run" / "checkpoints").name == "step-00000002"
        assert "the latest checkpoint, step-00000002 in run/checkpoints, is intact" in err
        assert "free memory and --resume, or start again with --overwrite and --batch-size 64 --grad-accum 2" in err


def test_cpu_allocator_failure_reads_as_out_of_memory():
    error = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                         "memory: you tried to allocate 140737488355328 bytes. Error code 12")
    assert memory.is_out_of_memory(error) and memory.is_out_of_memory(torch.OutOfMemoryError("x"))
    assert not memory.is_out_of_memory(RuntimeError("out of memory (simulated)"))


def test_the_advice_fits_what_does_not_fit():
    """Activations too large: batches k times smaller with k times the accumulation (--max-tokens
    for token batches), --bf16 on a GPU without it; weights, gradients and moments too large: only
    a smaller model (or LoRA for a loaded model); a resume: free memory (its batch and precision are
    the run's)."""
    cfg = TrainConfig(batch_size=64, grad_accum=2, bf16=False)
    mib = 2**20
    estimate = memory.TrainingMemory(weights=10 * mib, gradients=10 * mib, optimizer=20 * mib, step_temporary=0,
                                     activations=100 * mib)
    cuda, cpu = memory.Execution(device_type="cuda"), memory.Execution()
    assert memory._advice(estimate, 60 * mib, cfg, cpu, None, resume=False) == \
        "try --batch-size 16 --grad-accum 8, or a smaller model"  # 100 MiB of activations in 30: k = 4
    assert memory._advice(estimate, 60 * mib, cfg, cuda, 4096, resume=False) == \
        "try --max-tokens 1024 --grad-accum 8, or --bf16, or a smaller model"
    assert memory._advice(estimate, 35 * mib, cfg, cuda, None, resume=False) == "try a smaller model"
    # a loaded model trained whole: LoRA trains adapters only (no gradients or moments for the base)
    assert memory._advice(estimate, 35 * mib, cfg, cpu, None, resume=False, lora=True) == \
        "try --lora-rank 8, or a smaller model"
    assert "resumed run keeps its batch" in memory._advice(estimate, 60 * mib, cfg, cpu, None, resume=True)
