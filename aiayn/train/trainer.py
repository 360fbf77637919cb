"""Training a task into a run directory (marker, ``config.json``, ``checkpoints/``, ``metrics.csv``,
``summary.json``, plots). A non-finite loss, gradient norm or weight stops it with ``TrainingDiverged``;
``resume=True`` ends with the same weights and losses as an uninterrupted run (only timings differ)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from aiayn import device as devices
from aiayn.config import ConfigError, ModelConfig, TrainConfig
from aiayn.finetune.lora import LoraConfig, apply_lora
from aiayn.finetune.qlora import qlora_adapt
from aiayn.train import distributed, memory
from aiayn.train.averaging import choose_test_checkpoint
from aiayn.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, restore_rng
from aiayn.train.loop import (  # noqa: F401  (TrainingDiverged: imported from here too)
    StopRequest,
    TrainingDiverged,
    TrainingRun,
    loop,
    step_loss,
)
from aiayn.train.metrics import DeviceTotals, MetricsLog, MetricsWindow
from aiayn.train.optim import (
    load_optimizer_state,
    make_optimizer,
    make_schedule,
    schedule_warning,
    warmup_warning,
)
from aiayn.train.run_dir import RunDirError, RunLocation, atomic_write_text, prepare_run_dir  # noqa: F401
from aiayn.train.task import Task


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    final_loss: float  # training loss of the last step (smoothed if label smoothing is on)
    test_metrics: dict[str, float] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    interrupted: bool = False
    plots: list[Path] = field(default_factory=list)
    # Which weights scored the test split, last or averaged, and why (summary.json's test_checkpoint).
    test_checkpoint: dict[str, Any] = field(default_factory=dict)


def _seconds_of(state: dict[str, object]) -> float | None:
    """A checkpoint's training seconds (its state's ``elapsed_s``); None if absent or not a count."""
    seconds = state.get("elapsed_s")
    ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < math.inf
    return float(seconds) if ok else None  # type: ignore[arg-type]


def train(task: Task, model_config: ModelConfig, train_config: TrainConfig, run_dir: Path, *,
          resume: bool = False, overwrite: bool = False, progress: bool = True,
          echo: Callable[[str], None] = print, make_plots: bool = True,
          parallel: distributed.ParallelOptions | None = None, fast: bool = True,
          device: torch.device | str | None = None) -> TrainResult:
    """Train ``task`` into ``run_dir``. ``fast``: through aiayn's CPU kernels (the same function). ``device``:
    ``aiayn.device.resolve``'s; CUDA uses bfloat16 autocast unless ``train_config.bf16`` is False. Under
    torchrun it trains with DDP or FSDP (``aiayn.train.distributed``)."""
    distributed.check_options(parallel, world_size=distributed.env_world_size(), compile=train_config.compile,
                              average_last=train_config.average_last)
    if train_config.lora is not None:  # a LoRA config that cannot work fails before any run directory
        LoraConfig.from_dict(train_config.lora)
    if train_config.quantize is not None and not task.options.get("init_from"):
        raise ConfigError(f"quantize={train_config.quantize!r} keeps a loaded model's weights in 4 bits; give "
                          f"init_from (--init-from) to fine-tune one")
    ctx = distributed.setup(parallel, devices.prepare(devices.resolve(device)))
    try:
        configs = {"task": task.name, "task_options": task.options, "model": model_config.to_dict(),
                   "train": train_config.to_dict()}
        # Rank 0 checks and writes the directory; an error there is raised on every rank.
        location = distributed.run_on_main(
            ctx, lambda: prepare_run_dir(Path(run_dir), configs, resume=resume, overwrite=overwrite, echo=echo))
        location = distributed.from_main(ctx, location)
        assert location is not None
        echo = echo if ctx.is_main else lambda _: None
        try:
            model = _setup(task, model_config, train_config, location, ctx, fast=fast, resume=resume,
                           echo=echo)
            run = TrainingRun(task, train_config, location, ctx, echo, model)
            # A LoRA run on a model the task loads again (its init_from) saves only the adapters.
            run.adapters_only = train_config.lora is not None and bool(task.options.get("init_from"))
            _plan(run, model_config)
            if resume:  # weights go in before the model is wrapped or sharded (checkpoints hold full states)
                _resume(run)
            _optimizer(run)
            _records(run, resume=resume, progress=progress and ctx.is_main)
            with StopRequest().installed() as stop:
                loop(run, stop)
            run.bar.close()
            return _finish(run, make_plots=make_plots)
        except BaseException as exc:
            oom = (memory.out_of_memory(exc, location, task, train_config, ctx.device)
                   if memory.is_out_of_memory(exc) else None)
            if ctx.is_main:  # failed before the first checkpoint: the old run stays, the sibling goes
                location.abandon()
            if oom is not None:
                raise oom from exc
            raise
    finally:
        if ctx.owns_group:
            distributed.shutdown(ctx)


def _setup(task: Task, model_config: ModelConfig, cfg: TrainConfig, location: RunLocation,
           ctx: distributed.DistContext, *, fast: bool, resume: bool, echo: Callable[[str], None]) -> Any:
    """Seed, prepare the task's data, check the memory, build the model on the CPU, move it."""
    torch.manual_seed(cfg.seed)
    task.run_dir = location.path
    # Rank 0 prepares first: the others read what it writes (a learned tokenizer).
    distributed.run_on_main(ctx, lambda: task.prepare(cfg.seed))
    if ctx.enabled and not ctx.is_main:
        task.prepare(cfg.seed)
    lora = LoraConfig.from_dict(cfg.lora) if cfg.lora is not None else None
    adapt = None if lora is None else (lambda model: apply_lora(model, lora))
    if lora is not None and cfg.quantize == "q4":  # QLoRA: the frozen projections in 4-bit blocks
        source = getattr(task, "source", None)  # a fine-tune's loaded init_from
        adapt = qlora_adapt(lora, source.get().path if source is not None and source.given else None)
    memory.check_training_memory(task, model_config, cfg, ctx.device, fast=fast, resume=resume,
                                 world_size=ctx.world_size, fsdp=ctx.fsdp, echo=echo, adapt=adapt)
    model = task.build_model(model_config)
    if adapt is not None:
        adapt(model)
    model = model.to(ctx.device)
    if fast:  # the CPU kernels: same parameters and state dict (aiayn.fast)
        from aiayn.fast import optimize

        optimize(model, mode="train")
    return model


def _plan(run: TrainingRun, model_config: ModelConfig) -> None:
    """The schedule: steps per epoch and in all, each step's learning rate, when to evaluate and save."""
    task, cfg, ctx = run.task, run.cfg, run.ctx
    # Tasks may batch by token count, so ask for an epoch's batches rather than divide.
    batches_per_epoch = len(task.train_batches(0, cfg.batch_size, cfg.seed))
    run.per_step = cfg.grad_accum * ctx.world_size
    if ctx.enabled:
        distributed.check_world_size(ctx, batches_per_epoch=batches_per_epoch, grad_accum=cfg.grad_accum)
    steps_per_epoch = max(1, batches_per_epoch // run.per_step)
    run.total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    run.lr_at = make_schedule(cfg, total_steps=run.total_steps, d_model=model_config.d_model)
    if (warning := schedule_warning(cfg, d_model=model_config.d_model)) is not None:
        run.echo(warning)
    if (warning := warmup_warning(cfg, total_steps=run.total_steps, d_model=model_config.d_model)) is not None:
        run.echo(warning)
    run.eval_every = cfg.eval_every or steps_per_epoch
    run.save_every = cfg.save_every or steps_per_epoch


def _resume(run: TrainingRun) -> None:
    """The latest checkpoint's weights and the position it was saved at."""
    ckpt_dir = run.location.path / "checkpoints"
    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        raise CheckpointError(f"cannot resume: {ckpt_dir} holds no checkpoint yet; start the run "
                              f"again with --overwrite")
    run.loaded = loaded = load_checkpoint(latest, run.model)
    run.step, run.epoch, run.batch_in_epoch = loaded.step, loaded.state["epoch"], loaded.state["batch_in_epoch"]
    run.saved_step = run.step
    run.echo(f"resuming {run.location.final} from {latest.name} (step {run.step}, epoch {run.epoch})")


def _optimizer(run: TrainingRun) -> None:
    """Wrap the model for DDP/FSDP, compile the step, make the optimiser, restore a resumed run's state."""
    task, cfg, ctx, model = run.task, run.cfg, run.ctx, run.model
    frozen: list[str] = []  # parameters the loss never reaches, frozen for DDP/FSDP
    if ctx.enabled:
        def first_batch_loss() -> torch.Tensor:
            model.train()
            batch = devices.to_device(task.collate("train", task.train_batches(0, cfg.batch_size, cfg.seed)[0]),
                                      ctx.device)
            return step_loss(task, model, batch, device=ctx.device, bf16=cfg.bf16,
                             label_smoothing=cfg.label_smoothing)[0]

        frozen = distributed.freeze_unused(model, first_batch_loss)
    forward_model = run.forward_model = distributed.wrap(model, ctx)

    def forward_loss(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return step_loss(task, forward_model, batch, device=ctx.device, bf16=cfg.bf16,
                         label_smoothing=cfg.label_smoothing)

    run.step_forward = torch.compile(forward_loss) if cfg.compile else forward_loss
    with distributed.thawed(model, frozen):
        run.optimizer = make_optimizer(model, cfg, fused=devices.fused_optimizer(ctx.device))
    loaded = run.loaded
    if loaded is not None:
        if loaded.optimizer_state is not None:
            if ctx.fsdp:
                distributed.load_full_optimizer_state(model, run.optimizer, loaded.optimizer_state)
            else:
                load_optimizer_state(run.optimizer, loaded.optimizer_state)
        restore_rng(loaded)


def _records(run: TrainingRun, *, resume: bool, progress: bool) -> None:
    """metrics.csv, the training clock, the metrics window, the device's sums and the progress bar."""
    loaded = run.loaded
    run.metrics = distributed.run_on_main(
        run.ctx, lambda: MetricsLog(run.location.path / "metrics.csv", resume_step=run.step if resume else None))
    # Training time along the saved path: a resumed run goes on from its checkpoint's count.
    run.resumed_at = (run.saved_step, _seconds_of(loaded.state)) if loaded is not None else None
    seconds_before = (run.resumed_at[1] or 0.0) if run.resumed_at is not None else 0.0
    run.start_time = time.perf_counter() - seconds_before
    run.window = (MetricsWindow.restored(loaded.state.get("metrics_window", {}), run.ctx) if loaded
                  else MetricsWindow())
    run.totals = DeviceTotals(run.ctx.device)
    run.bar = tqdm(total=run.total_steps, initial=run.step, disable=not progress, desc=f"train {run.task.name}",
                   unit="step", dynamic_ncols=True)


def _finish(run: TrainingRun, *, make_plots: bool) -> TrainResult:
    """The end: test the better of the last and the averaged weights, write summary.json and the plots."""
    task, model, location, ctx, step, echo = run.task, run.model, run.location, run.ctx, run.step, run.echo
    run_dir = location.final
    result = TrainResult(run_dir=run_dir, step=step, final_loss=float(run.last_loss), interrupted=run.interrupted)
    if run.interrupted:
        echo(f"interrupted at step {step}; checkpoint saved. Continue with: aiayn train --resume "
             f"--run-dir {run_dir}")
        return result
    last_val = run.last_val
    result.test_checkpoint, averaged = choose_test_checkpoint(
        task, model, location.path, run.cfg.average_last, ctx=ctx, echo=echo,
        last_val=last_val[1] if last_val is not None and last_val[0] == step else None)
    # Every rank evaluates (a sharded model's forward is a collective); rank 0 writes.
    result.test_metrics = task.evaluate(model, task.test_split)
    result.examples = task.examples(model)
    summary = {"step": step, "final_train_loss": result.final_loss, "test": result.test_metrics,
               "seconds": time.perf_counter() - run.start_time}
    if run.resumed_at is not None:
        summary["resumed"] = {"step": run.resumed_at[0], "seconds": run.resumed_at[1]}
    summary["test_checkpoint"] = result.test_checkpoint
    if averaged:
        summary["averaged"] = averaged
    if ctx.is_main:
        atomic_write_text(location.path / "summary.json", json.dumps(summary, indent=2) + "\n")
    if make_plots:
        from aiayn import viz

        example = task.attention_example(model)
        if not ctx.is_main:
            return result
        result.plots.append(viz.plot_metrics(location.path / "metrics.csv", location.path / "curves.png"))
        if example is not None:
            result.plots.append(viz.plot_attention(example.weights, example.query_labels,
                                                   example.key_labels, location.path / "attention.png",
                                                   title=example.title))
    return result
