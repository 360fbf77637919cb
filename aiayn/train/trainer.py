"""The training loop: run directory, progress bar, metrics, checkpoints, exact resume, Ctrl-C.

A run directory holds its marker ``.aiayn-run``, ``config.json`` (task, model and training configs),
``checkpoints/``, ``metrics.csv``, ``summary.json`` and the plots (``aiayn.train.run_dir``: how a run
is created, or replaced only once the new one holds a checkpoint). A NaN or infinite loss, gradient
norm or weight stops training with ``TrainingDiverged``; nothing is saved after it. ``train(..., resume=True)`` continues from the
latest checkpoint and ends with the same weights and losses as an uninterrupted run: the data order
is a function of (seed, epoch), the learning rate a function of the step, and the RNG, optimiser,
data position and the partial metrics window are restored from the checkpoint (only the timing
columns of metrics.csv differ).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from aiayn import device as devices
from aiayn.config import ModelConfig, TrainConfig
from aiayn.cpu_share import share_cores
from aiayn.train import distributed, memory
from aiayn.train.averaging import choose_test_checkpoint
from aiayn.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from aiayn.train.losses import sequence_loss
from aiayn.train.metrics import METRIC_FIELDS, DeviceTotals, MetricsLog, MetricsWindow  # noqa: F401
from aiayn.train.optim import (
    all_finite,
    clip_and_measure,
    load_optimizer_state,
    make_optimizer,
    make_schedule,
    schedule_warning,
    warmup_warning,
)
from aiayn.train.run_dir import (  # noqa: F401  (RunDirError, config_diff: imported from here too)
    RunDirError,
    RunLocation,
    atomic_write_text,
    config_diff,
    from_main,
    prepare_run_dir,
)
from aiayn.train.task import Task


class TrainingDiverged(RuntimeError):
    """The loss, gradient norm or weights became non-finite (NaN or infinite). Training stopped at
    that step and saved nothing after it: the run's latest checkpoint is the last good one."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


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


class StopRequest:
    """First Ctrl-C (or SIGTERM): finish the step, save, exit. Second Ctrl-C: exit at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            os._exit(130)
        self.requested = True
        tqdm.write("stopping: saving a checkpoint after this step (Ctrl-C again to quit at once)")

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: no handlers, plain behaviour
            pass
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)


def _seconds_of(state: dict[str, object]) -> float | None:
    """A checkpoint's training seconds (its state's ``elapsed_s``); None if absent or not a count."""
    seconds = state.get("elapsed_s")
    ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < math.inf
    return float(seconds) if ok else None  # type: ignore[arg-type]


def train(
    task: Task,
    model_config: ModelConfig,
    train_config: TrainConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    make_plots: bool = True,
    parallel: distributed.ParallelOptions | None = None,
    fast: bool = True,
    device: torch.device | str | None = None,
) -> TrainResult:
    """Train ``task`` into ``run_dir``; see the module docstring.

    ``fast``: train through aiayn's CPU kernels (``aiayn.fast.optimize(model, "train")``: the same
    function, faster); False trains the plain PyTorch model. On another device the plain model runs.

    ``device``: where to train (``aiayn.device.resolve``: "auto" or None takes the first CUDA GPU,
    else the CPU). The model, optimiser state and batches live there; on CUDA the forward runs
    under bfloat16 autocast unless ``train_config.bf16`` is False, and Adam is fused. Checkpoints
    are device-free: a run saved on a GPU resumes on the CPU and back.

    Under torchrun (``WORLD_SIZE`` > 1) it trains data-parallel (DDP) or sharded
    (``parallel.fsdp``); see ``aiayn.train.distributed`` for how batches and the loss are split.
    """
    distributed.check_options(parallel, world_size=distributed.env_world_size(), compile=train_config.compile,
                              average_last=train_config.average_last)
    ctx = distributed.setup(parallel, devices.prepare(devices.resolve(device)))
    try:
        configs = {"task": task.name, "task_options": task.options, "model": model_config.to_dict(),
                   "train": train_config.to_dict()}
        # Rank 0 checks and writes the directory (a replaced run goes to a temporary sibling, whose
        # name the other ranks learn from it); an error there is raised on every rank.
        location = distributed.run_on_main(
            ctx, lambda: prepare_run_dir(Path(run_dir), configs, resume=resume, overwrite=overwrite, echo=echo))
        location = from_main(ctx, location)
        assert location is not None
        try:
            return _train(task, model_config, train_config, location, ctx, resume=resume,
                          progress=progress and ctx.is_main, echo=echo if ctx.is_main else _quiet,
                          make_plots=make_plots, fast=fast)
        except BaseException as exc:
            # Out of memory: one line naming what is kept and the fix (written before abandon()).
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


def step_loss(task: Task, model: Any, batch: Any, *, device: torch.device, bf16: bool | None = None,
              label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One micro-batch's forward and loss on ``device`` -> (loss, summed NLL, counted tokens,
    correct tokens), 0-dim tensors: the step that ``--compile`` compiles whole. Neither the model
    nor the loss reads a value back into Python, so the graph has no break and a GPU never waits
    in it (tests/unit/test_compiled_step.py counts the breaks with ``torch._dynamo.explain``)."""
    with devices.autocast(device, bf16=bf16):
        output, targets = task.forward(model, batch)
        out = sequence_loss(output, targets, label_smoothing=label_smoothing)
    return out.loss, out.nll_sum, out.n_tokens, out.n_correct


def _quiet(_: str) -> None:
    pass


def _diverged_message(step: int, what: str, saved_step: int | None, location: RunLocation, *, clipping: bool) -> str:
    if saved_step is not None:
        kept = (f"nothing was saved after it: the latest checkpoint is still step-{saved_step:08d} in "
                f"{location.path / 'checkpoints'}")
    elif location.pending:
        kept = f"no checkpoint had been saved, and the run it was to replace, {location.final}, is untouched"
    elif location.fresh:  # abandon() empties it: the same command can start again
        kept = f"no checkpoint had been saved, so {location.final} was left as it was before this start"
    else:
        kept = "no checkpoint had been saved"
    fix = "a lower --lr" if clipping else "a lower --lr, or clip gradients with --clip-grad-norm"
    return f"training diverged at step {step} ({what}); {kept}. Start again with {fix}"


def _train(
    task: Task,
    model_config: ModelConfig,
    train_config: TrainConfig,
    location: RunLocation,
    ctx: distributed.DistContext,
    *,
    resume: bool,
    progress: bool,
    echo: Callable[[str], None],
    make_plots: bool,
    fast: bool,
) -> TrainResult:
    cfg = train_config
    dev = ctx.device
    run_dir = location.final  # where the run ends up; it is written in location.path until then
    torch.manual_seed(cfg.seed)  # (seeds the CUDA generators too)
    task.run_dir = location.path
    # Rank 0 prepares first: a task may write files into the run (a learned tokenizer) that the
    # other ranks then read instead of learning their own.
    distributed.run_on_main(ctx, lambda: task.prepare(cfg.seed))
    if ctx.enabled and not ctx.is_main:
        task.prepare(cfg.seed)
    # Refuse a step that cannot fit (weights, gradients, Adam, activations) before allocating any.
    memory.check_training_memory(task, model_config, cfg, dev, fast=fast, resume=resume,
                                 world_size=ctx.world_size, fsdp=ctx.fsdp)
    model = task.build_model(model_config).to(dev)  # built on the CPU (same initial weights everywhere)
    if fast:  # the CPU kernels: same parameters and state dict, same function (aiayn.fast)
        from aiayn.fast import optimize

        optimize(model, mode="train")
    # Tasks may batch by token count, so ask for an epoch's batches rather than divide.
    batches_per_epoch = len(task.train_batches(0, cfg.batch_size, cfg.seed))
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum)
    per_step = cfg.grad_accum * ctx.world_size  # batches of the task's list consumed per step
    if ctx.enabled:
        n_batches = len(task.train_batches(0, cfg.batch_size, cfg.seed))
        distributed.check_world_size(ctx, batches_per_epoch=n_batches, grad_accum=cfg.grad_accum)
        steps_per_epoch = max(1, n_batches // per_step)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    lr_at = make_schedule(cfg, total_steps=total_steps, d_model=model_config.d_model)
    if (warning := schedule_warning(cfg, d_model=model_config.d_model)) is not None:
        echo(warning)
    if (warning := warmup_warning(cfg, total_steps=total_steps, d_model=model_config.d_model)) is not None:
        echo(warning)
    eval_every = cfg.eval_every or steps_per_epoch
    save_every = cfg.save_every or steps_per_epoch

    step, epoch, batch_in_epoch = 0, 0, 0
    loaded = None
    saved_step: int | None = None  # the step of the run's latest checkpoint
    if resume:  # weights go in before the model is wrapped or sharded (checkpoints hold full states)
        ckpt_dir = location.path / "checkpoints"
        latest = latest_checkpoint(ckpt_dir)
        if latest is None:
            raise CheckpointError(f"cannot resume: {ckpt_dir} holds no checkpoint yet; start the run "
                                  f"again with --overwrite")
        loaded = load_checkpoint(latest, model)
        # batch_in_epoch counts batches of the task's list, whatever the world size that saved it.
        step, epoch, batch_in_epoch = loaded.step, loaded.state["epoch"], loaded.state["batch_in_epoch"]
        saved_step = step
        echo(f"resuming {run_dir} from {latest.name} (step {step}, epoch {epoch})")
    frozen: list[str] = []  # parameters the loss never reaches, frozen for DDP/FSDP
    if ctx.enabled:
        def first_batch_loss() -> torch.Tensor:
            model.train()
            batch = devices.to_device(task.collate("train", task.train_batches(0, cfg.batch_size, cfg.seed)[0]), dev)
            with devices.autocast(dev, bf16=cfg.bf16):
                output, targets = task.forward(model, batch)
                return sequence_loss(output, targets, label_smoothing=cfg.label_smoothing).loss

        frozen = distributed.freeze_unused(model, first_batch_loss)
    forward_model = distributed.wrap(model, ctx)

    def forward_loss(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return step_loss(task, forward_model, batch, device=dev, bf16=cfg.bf16,
                         label_smoothing=cfg.label_smoothing)

    step_forward = torch.compile(forward_loss) if cfg.compile else forward_loss
    with distributed.thawed(model, frozen):
        optimizer = make_optimizer(model, cfg, fused=devices.fused_optimizer(dev))
    if loaded is not None:
        if loaded.optimizer_state is not None:
            if ctx.fsdp:
                distributed.load_full_optimizer_state(model, optimizer, loaded.optimizer_state)
            else:
                load_optimizer_state(optimizer, loaded.optimizer_state)
        restore_rng(loaded)
    metrics = distributed.run_on_main(
        ctx, lambda: MetricsLog(location.path / "metrics.csv", resume_step=step if resume else None))

    def log_row(**row: Any) -> None:
        if metrics is not None:
            metrics.write(**row)

    def diverged(what: str, at: int | None = None) -> TrainingDiverged:
        bar.close()
        at = step if at is None else at
        return TrainingDiverged(_diverged_message(at, what, saved_step, location,
                                                  clipping=cfg.clip_grad_norm is not None), at)

    def read_totals() -> None:
        """Fold the device's sums into the window (one sync) and stop if a step diverged."""
        bad = totals.fold(window)
        if bad is not None:
            at, loss, norm = bad
            clipping = cfg.clip_grad_norm is not None
            raise diverged(f"loss {loss:.4g}" + (f", gradient norm {norm:.4g}" if clipping else ""), at)

    def checkpoint() -> None:
        nonlocal saved_step
        read_totals()  # the divergence guard first: a diverged step is named as such
        model_state = optimizer_state = None
        if ctx.fsdp:  # gather the full state on every rank (a collective); rank 0 writes it
            model_state, optimizer_state = distributed.full_state(model, optimizer, ctx)
        # Never save non-finite weights (without clipping a gradient is not measured, so an
        # overflow can reach the weights with the loss still finite); every rank sees the same.
        if not all_finite(model_state.values() if model_state is not None else model.parameters()):
            raise diverged("the weights hold NaN or infinite values")

        def save() -> None:
            save_checkpoint(location.path / "checkpoints", step=step, model=model, optimizer=optimizer,
                            keep=cfg.keep_checkpoints, state={"epoch": epoch, "batch_in_epoch": batch_in_epoch,
                                   "metrics_window": window_state,
                                   "elapsed_s": time.perf_counter() - start_time},
                            model_state=model_state, optimizer_state=optimizer_state)
            location.swap_in()  # a replaced run: the new one takes its place once it holds a checkpoint

        window_state = window.saved(ctx)  # a collective: every rank, before rank 0 saves
        moving = location.pending
        distributed.run_on_main(ctx, save)
        saved_step = step
        if moving:  # every rank follows the run to its final place
            location.swapped()
            task.run_dir = location.path
            if metrics is not None:
                metrics.path = location.path / "metrics.csv"

    # The run's training time along its saved path: a resumed run goes on from its checkpoint's
    # count (elapsed_s in metrics.csv, "seconds" in summary.json), so the time after that checkpoint
    # that a kill threw away is not counted, and what is done again is. A checkpoint from before
    # the count was kept gives None: then the count starts at the resume.
    resumed_at = (saved_step, _seconds_of(loaded.state)) if loaded is not None else None
    seconds_before = (resumed_at[1] or 0.0) if resumed_at is not None else 0.0
    start_time = time.perf_counter() - seconds_before
    window = MetricsWindow.restored(loaded.state.get("metrics_window", {}), ctx) if loaded else MetricsWindow()
    totals = DeviceTotals(dev)
    last_loss: Tensor | float = float("nan")
    last_val: tuple[int, dict[str, float]] | None = None  # (step, val metrics) of the latest validation
    interrupted = False
    bar = tqdm(total=total_steps, initial=step, disable=not progress, desc=f"train {task.name}",
               unit="step", dynamic_ncols=True)
    stop = StopRequest()
    # Whether to stop now: one process stops as soon as it is asked (a signal); several stop together
    # at the first metrics row or checkpoint after any of them was asked (their vote is a collective
    # and a read of the device, so it is not taken every step).
    stopping = False
    with stop.installed():
        while step < total_steps and not stopping:
            batches = task.train_batches(epoch, cfg.batch_size, cfg.seed)
            while batch_in_epoch + per_step <= len(batches) and step < total_steps:
                share_cores()  # this job's fair share of the cores beside other aiayn jobs (aiayn/cpu_share.py)
                model.train()
                group = batches[batch_in_epoch : batch_in_epoch + per_step]
                if ctx.enabled:  # this rank's share of the step's window: window[rank::world]
                    group = distributed.shard(group, ctx)
                lr = lr_at(step + 1)
                for param_group in optimizer.param_groups:
                    param_group["lr"] = lr
                loss_of_step: Tensor | float = 0.0
                for i, indices in enumerate(group):
                    batch = task.collate("train", indices)
                    window.in_tokens += task.count_tokens(batch)  # counted on the host, before the copy
                    batch = devices.to_device(batch, dev)
                    if not ctx.enabled:
                        loss, nll_sum, n_tokens, n_correct = step_forward(batch)
                        (loss / len(group)).backward()
                        loss_of_step = loss_of_step + loss.detach().double() / len(group)
                        totals.add_batch(nll_sum, n_tokens, n_correct)
                    else:
                        with distributed.no_sync(forward_model, last=i == len(group) - 1):
                            with devices.autocast(dev, bf16=cfg.bf16):
                                output, targets = task.forward(forward_model, batch)
                                out = sequence_loss(output, targets, label_smoothing=cfg.label_smoothing)
                            # Weight by this rank's share of the micro-batch's tokens over all ranks:
                            # the gradient average is then that of the union's token-mean loss. The
                            # counts stay on the device (a collective per micro-batch, nothing read).
                            weight = distributed.token_share(out.n_tokens, ctx)  # () float64
                            # A rank without counted tokens adds 0 (its loss is NaN, its gradients 0).
                            counted = out.n_tokens > 0
                            loss = torch.where(counted, out.loss * weight.to(out.loss.dtype), 0.0)
                            (loss / len(group)).backward()
                        share = torch.where(counted, out.loss.detach().double() * weight, 0.0)
                        loss_of_step = loss_of_step + share / ctx.world_size / len(group)
                        totals.add_batch(out.nll_sum, out.n_tokens, out.n_correct)
                grad_norm = clip_and_measure(model.parameters(), cfg.clip_grad_norm)  # None: not clipping
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                batch_in_epoch += per_step
                if ctx.enabled:  # the union's loss, summed on the device (a collective, nothing read)
                    loss_of_step = distributed.all_reduce_tensor(loss_of_step, ctx)
                # The divergence guard watches the loss (the union's, so every rank stops alike)
                # and, when clipping, the gradient norm, on the device; it is read with the
                # metrics (below), before any evaluation or save: nothing is logged or saved for
                # a diverged step or after it.
                assert isinstance(loss_of_step, Tensor)
                totals.add_step(step, loss_of_step, grad_norm)
                last_loss = loss_of_step
                window.steps += 1
                bar.update(1)
                at_row = step % cfg.log_every == 0 or step == total_steps
                if not ctx.enabled:
                    stopping = stop.requested
                elif at_row or step % save_every == 0:  # every rank reaches these steps together
                    stopping = distributed.any_rank(stop.requested, ctx)

                if at_row:
                    read_totals()
                    window.reduce(ctx)
                    elapsed = time.perf_counter() - window.start
                    mean_loss = window.loss / window.steps
                    tokens_per_s = window.in_tokens / max(elapsed, 1e-9)
                    bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}",
                                    epoch=epoch)
                    log_row(step=step, epoch=epoch, lr=lr, train_loss=mean_loss,
                            train_nll=window.nll / max(window.tokens, 1),
                            train_acc=window.correct / max(window.tokens, 1),
                            tokens_per_s=tokens_per_s, elapsed_s=time.perf_counter() - start_time)
                    window = MetricsWindow()
                if step % eval_every == 0 or step == total_steps:
                    read_totals()
                    val = task.evaluate(model, "val")
                    last_val = (step, val)
                    log_row(step=step, epoch=epoch, val_nll=val["nll"], val_ppl=math.exp(min(val["nll"], 50)),
                            val_acc=val["acc"], val_seq_acc=val["seq_acc"], val_bleu=val.get("bleu"),
                            elapsed_s=time.perf_counter() - start_time)
                    if ctx.is_main:
                        bar.write(f"step {step}: val " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))
                if step % save_every == 0 or step == total_steps or stopping:
                    checkpoint()
                if stopping:
                    interrupted = True
                    break
            else:
                epoch, batch_in_epoch = epoch + 1, 0
                continue
            if stopping:
                break
    bar.close()

    result = TrainResult(run_dir=run_dir, step=step, final_loss=float(last_loss), interrupted=interrupted)
    if interrupted:
        echo(f"interrupted at step {step}; checkpoint saved. Continue with: aiayn train --resume "
             f"--run-dir {run_dir}")
        return result

    # The paper's checkpoint averaging (section 6.1, aiayn.train.averaging): the test split is
    # scored with the better of the last and the averaged weights on val (the model holds them).
    result.test_checkpoint, averaged = choose_test_checkpoint(
        task, model, location.path, cfg.average_last, ctx=ctx, echo=echo,
        last_val=last_val[1] if last_val is not None and last_val[0] == step else None)

    # Every rank evaluates (a sharded model's forward is a collective); rank 0 writes.
    result.test_metrics = task.evaluate(model, task.test_split)
    result.examples = task.examples(model)
    summary = {"step": step, "final_train_loss": result.final_loss, "test": result.test_metrics,
               "seconds": time.perf_counter() - start_time}
    if resumed_at is not None:
        summary["resumed"] = {"step": resumed_at[0], "seconds": resumed_at[1]}
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

