"""Helpers of tests/integration/test_distributed.py: a task whose batches are the union of the
ranks' batches (the single-process reference) and the worker each spawned rank runs."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from aiayn.config import ModelConfig, TrainConfig
from aiayn.tasks.base import Task
from aiayn.tasks.copy import CopyTask
from aiayn.tasks.reverse import ReverseTask

N_TRAIN = 250  # 16 batches of 16, the last one of 10: ranks' batches of a step can differ in size
BATCH = 16


class UnionBatches(Task):
    """A task whose batch i is the union of batches i*w .. i*w + w - 1 of the plain task: what a
    w-process run sees as one global batch per step."""

    def __init__(self, *, world: int = 2, **options: Any) -> None:
        super().__init__(**options)
        self.world = world

    def train_batches(self, epoch: int, batch_size: int, seed: int) -> list[torch.Tensor]:
        plain = super().train_batches(epoch, batch_size, seed)
        usable = len(plain) - len(plain) % self.world
        return [torch.cat(plain[i : i + self.world]) for i in range(0, usable, self.world)]


class UnionReverse(UnionBatches, ReverseTask):
    """Reverse (an encoder-only model: the loss takes its MLM logits)."""


class UnionCopy(UnionBatches, CopyTask):
    """Copy (an encoder-decoder given its targets: the output layer runs fused with the loss)."""


TASKS: dict[str, tuple[type[Task], type[Task]]] = {"reverse": (ReverseTask, UnionReverse),
                                                   "copy": (CopyTask, UnionCopy)}


def small_task(task: str = "reverse", *, union: bool = False, **kw: Any) -> Task:
    """The plain task, or with ``union`` its single-process reference for a 2-process run."""
    plain, union_cls = TASKS[task]
    return (union_cls if union else plain)(n_train=N_TRAIN, n_val=64, n_test=64, **kw)


def small_model(task: Task) -> ModelConfig:
    return task.model_config().replace(n_layers=2, n_heads=2, dropout=0.0, attention_dropout=0.0)


def small_train(**kw: Any) -> TrainConfig:
    base = dict(max_steps=8, batch_size=BATCH, lr=3e-3, warmup_steps=2, schedule="cosine",
                clip_grad_norm=5.0, log_every=1, eval_every=1000, save_every=4)
    return TrainConfig(**{**base, **kw})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, run_dir: str, fsdp: bool, task_name: str,
           train_kw: dict[str, Any]) -> None:
    """One rank of a spawned job: torchrun's environment, then the ordinary trainer."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from aiayn.train.distributed import ParallelOptions
    from aiayn.train.trainer import train

    train_kw = dict(train_kw)
    resume = train_kw.pop("resume", False)
    reads: list[str] | None = [] if train_kw.pop("count_reads", False) else None
    task = small_task(task_name)
    with reads_of_the_trainer(reads):
        result = train(task, small_model(task), small_train(**train_kw), Path(run_dir), progress=False,
                       make_plots=False, parallel=ParallelOptions(fsdp=fsdp), resume=resume)
    if reads is not None:
        (Path(run_dir) / f"reads-rank{rank}.json").write_text(json.dumps(reads))
    if rank == 0:
        (Path(run_dir) / "rank0.json").write_text(json.dumps({"final_loss": result.final_loss}))


# Every way a tensor's value gets into Python (on a GPU each waits for the device), and the
# training loop's own files (the task's evaluation and the checkpoint files are not the step).
READS = ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__")
TRAINER_FILES = ("trainer.py", "loop.py", "metrics.py", "distributed.py", "losses.py", "optim.py")


@contextlib.contextmanager
def reads_of_the_trainer(reads: list[str] | None) -> Iterator[None]:
    """With a list: note in it, as "file:function (method)", every read of a tensor's value made by
    the training loop's code (aiayn/train/: the step, its metrics, the collectives, the loss)."""
    if reads is None:
        yield
        return
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def spy(name: str):
        original = saved[name]

        def read(self, *args, **kwargs):
            code = sys._getframe(1).f_code
            where = Path(code.co_filename)
            if where.parent.name == "train" and where.parent.parent.name == "aiayn" and where.name in TRAINER_FILES:
                reads.append(f"{where.name}:{code.co_name} ({name})")
            return original(self, *args, **kwargs)

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, spy(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def spawn(world: int, run_dir: Path, *, fsdp: bool = False, task: str = "reverse", **train_kw: Any) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(world, free_port(), str(run_dir), fsdp, task, train_kw), nprocs=world,
                       start_method="spawn")


def tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Tensor parallelism: outputs and gradients of split models equal the full model's."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from aiayn import build_model
    from aiayn.train.parallel import TensorParallelError, apply_tensor_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    configs = {
        # LLaMA-style: GQA (4 heads, 2 kv heads), RoPE, SwiGLU (gated fc_in), RMSNorm, no biases.
        "llama": ModelConfig(arch="decoder-only", vocab_size=99, d_model=48, n_heads=4, n_kv_heads=2,
                             n_layers=2, d_ff=38, activation="swiglu", norm="rmsnorm", norm_position="pre",
                             positional="rope", bias=False, scale_embeddings=False, pad_id=None),
        # The paper's encoder-decoder: post-norm, sinusoidal, cross-attention (q and fused kv), biases.
        "paper": ModelConfig(arch="encoder-decoder", vocab_size=99, d_model=32, n_heads=4, n_layers=2,
                             d_ff=38, pad_id=0),
    }
    for name, cfg in configs.items():
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        tokens = torch.randint(1, 99, (3, 9), generator=torch.Generator().manual_seed(1))

        def run(m: torch.nn.Module, tokens: torch.Tensor = tokens,
                cfg: ModelConfig = cfg) -> tuple[torch.Tensor, torch.Tensor]:
            m.zero_grad()
            out = m(tokens).logits if cfg.arch == "decoder-only" else m(tokens, tokens[:, :7]).logits
            out.square().mean().backward()
            return out.detach(), m.lm_head.weight.grad.clone()

        want, want_grad = run(model)
        apply_tensor_parallel(model, mesh)
        got, got_grad = run(model)
        attn = next(m for m in model.modules() if type(m).__name__ == "MultiHeadAttention")
        results[name] = {"out_err": (got - want).abs().max().item(), "grad_err": (got_grad - want_grad).abs().max().item(),
                         "scale": want.abs().max().item(), "local_heads": [attn.n_heads, attn.n_kv_heads]}
    try:
        apply_tensor_parallel(build_model(configs["llama"].replace(positional="alibi")), mesh)
        results["alibi"] = "accepted"
    except TensorParallelError as exc:
        results["alibi"] = str(exc)
    if rank == 0:
        (Path(out_dir) / "tp.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def spawn_tp(world: int, out_dir: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(tp_worker, args=(world, free_port(), str(out_dir)), nprocs=world, start_method="spawn")
