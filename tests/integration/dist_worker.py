"""Helpers of tests/integration/test_distributed.py: a task whose batches are the union of the
ranks' batches (the single-process reference) and the worker each spawned rank runs."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch

from aiayn.config import ModelConfig, TrainConfig
from aiayn.tasks.reverse import ReverseTask

N_TRAIN = 250  # 16 batches of 16, the last one of 10: ranks' batches of a step can differ in size
BATCH = 16


class UnionReverse(ReverseTask):
    """The reverse task whose batch i is the union of batches i*w .. i*w + w - 1 of the plain task:
    what a w-process run sees as one global batch per step."""

    def __init__(self, *, world: int = 2, **options: Any) -> None:
        super().__init__(**options)
        self.world = world

    def train_batches(self, epoch: int, batch_size: int, seed: int) -> list[torch.Tensor]:
        plain = super().train_batches(epoch, batch_size, seed)
        usable = len(plain) - len(plain) % self.world
        return [torch.cat(plain[i : i + self.world]) for i in range(0, usable, self.world)]


def small_task(cls: type[ReverseTask] = ReverseTask, **kw: Any) -> ReverseTask:
    return cls(n_train=N_TRAIN, n_val=64, n_test=64, **kw)


def small_model(task: ReverseTask) -> ModelConfig:
    return task.model_config().replace(n_layers=2, n_heads=2, dropout=0.0, attention_dropout=0.0)


def small_train(**kw: Any) -> TrainConfig:
    base = dict(max_steps=8, batch_size=BATCH, lr=3e-3, warmup_steps=2, schedule="cosine",
                clip_grad_norm=5.0, log_every=1, eval_every=1000, save_every=4)
    return TrainConfig(**{**base, **kw})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, run_dir: str, fsdp: bool, train_kw: dict[str, Any]) -> None:
    """One rank of a spawned job: torchrun's environment, then the ordinary trainer."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from aiayn.train.distributed import ParallelOptions
    from aiayn.train.trainer import train

    task = small_task()
    result = train(task, small_model(task), small_train(**train_kw), Path(run_dir), progress=False,
                   make_plots=False, parallel=ParallelOptions(fsdp=fsdp))
    if rank == 0:
        (Path(run_dir) / "rank0.json").write_text(json.dumps({"final_loss": result.final_loss}))


def spawn(world: int, run_dir: Path, *, fsdp: bool = False, **train_kw: Any) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(world, free_port(), str(run_dir), fsdp, train_kw), nprocs=world,
                       start_method="spawn")
