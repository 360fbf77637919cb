"""``loop`` runs a set-up ``TrainingRun`` to its last step or a stop request. Nothing reads a tensor between
metrics rows and checkpoints, so a GPU never waits."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from aiayn import device as devices
from aiayn.config import TrainConfig
from aiayn.cpu_share import share_cores
from aiayn.finetune.lora import is_adapter_key
from aiayn.train import distributed
from aiayn.train.checkpoint import ADAPTER_WEIGHTS, save_checkpoint
from aiayn.train.losses import sequence_loss
from aiayn.train.metrics import MetricsLog, MetricsWindow
from aiayn.train.optim import all_finite, clip_and_measure
from aiayn.train.run_dir import RunLocation
from aiayn.train.task import Task


class TrainingDiverged(RuntimeError):
    """The loss, gradient norm or weights became non-finite; nothing was saved after that step."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


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
        with contextlib.suppress(ValueError):  # not the main thread: no handlers, plain behaviour
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)


@dataclass
class TrainingRun:
    """One run's state: what setup fixed and what the loop moves (position, metrics window, sums)."""

    task: Task
    cfg: TrainConfig
    location: RunLocation
    ctx: distributed.DistContext
    echo: Callable[[str], None]
    model: Any
    total_steps: int = 0
    per_step: int = 1  # batches of the task's list consumed per step
    eval_every: int = 1
    save_every: int = 1
    adapters_only: bool = False  # checkpoints hold only the LoRA adapters (the task rebuilds the base)
    lr_at: Callable[[int], float] = float
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of the task's list, whatever the world size
    saved_step: int | None = None  # the step of the run's latest checkpoint
    loaded: Any = None  # the checkpoint resumed from
    forward_model: Any = None  # the model as wrapped for DDP/FSDP
    step_forward: Callable[[Any], tuple[Tensor, Tensor, Tensor, Tensor]] | None = None
    optimizer: Any = None
    metrics: MetricsLog | None = None
    resumed_at: tuple[int | None, float | None] | None = None  # (step, training seconds) resumed from
    start_time: float = 0.0
    window: Any = None  # the MetricsWindow of the current metrics row
    totals: Any = None  # the DeviceTotals: sums kept on the device between rows
    bar: Any = None
    last_loss: Tensor | float = math.nan
    last_val: tuple[int, dict[str, float]] | None = None  # (step, val metrics) of the latest validation
    interrupted: bool = False


def loop(run: TrainingRun, stop: StopRequest) -> None:
    """Steps epoch by epoch until the last step, or a stop request (saved, then interrupted)."""
    cfg = run.cfg
    while run.step < run.total_steps and not run.interrupted:
        batches = run.task.train_batches(run.epoch, cfg.batch_size, cfg.seed)
        while run.batch_in_epoch + run.per_step <= len(batches) and run.step < run.total_steps:
            lr = _train_step(run, batches[run.batch_in_epoch : run.batch_in_epoch + run.per_step])
            if _after_step(run, stop, lr):
                run.interrupted = True
                break
        else:
            run.epoch, run.batch_in_epoch = run.epoch + 1, 0


def _train_step(run: TrainingRun, group: list[Any]) -> float:
    """One optimiser step over ``group``: forward and backward per micro-batch, clip, step; returns the lr."""
    ctx, optimizer = run.ctx, run.optimizer
    share_cores()  # this job's fair share of the cores beside other aiayn jobs
    run.model.train()
    if ctx.enabled:  # this rank's share of the step's window: window[rank::world]
        group = distributed.shard(group, ctx)
    lr = run.lr_at(run.step + 1)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    loss_of_step: Tensor | float = 0.0
    for i, indices in enumerate(group):
        batch = run.task.collate("train", indices)
        run.window.in_tokens += run.task.count_tokens(batch)  # counted on the host, before the copy
        batch = devices.to_device(batch, ctx.device)
        loss_of_step = loss_of_step + _forward_backward(run, batch, len(group), last=i == len(group) - 1)
    grad_norm = clip_and_measure(run.model.parameters(), run.cfg.clip_grad_norm)  # None: not clipping
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.batch_in_epoch += run.per_step
    if ctx.enabled:  # the union's loss, summed on the device (a collective, nothing read)
        loss_of_step = distributed.all_reduce_tensor(loss_of_step, ctx)
    assert isinstance(loss_of_step, Tensor)
    run.totals.add_step(run.step, loss_of_step, grad_norm)
    run.last_loss = loss_of_step
    run.window.steps += 1
    run.bar.update(1)
    return lr


def step_loss(task: Task, model: Any, batch: Any, *, device: torch.device, bf16: bool | None = None,
              label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One micro-batch's forward and loss on ``device`` -> (loss, summed NLL, counted tokens, correct tokens),
    0-dim tensors: the step ``--compile`` compiles whole, with no read back into Python."""
    with devices.autocast(device, bf16=bf16):
        output, targets = task.forward(model, batch)
        out = sequence_loss(output, targets, label_smoothing=label_smoothing)
    return out.loss, out.nll_sum, out.n_tokens, out.n_correct


def _forward_backward(run: TrainingRun, batch: Any, n: int, *, last: bool) -> Tensor:
    """One micro-batch of ``n``: forward, backward of its share of the step's loss; returns that share."""
    ctx, cfg = run.ctx, run.cfg
    if not ctx.enabled:
        assert run.step_forward is not None
        loss, nll_sum, n_tokens, n_correct = run.step_forward(batch)
        (loss / n).backward()
        share = loss.detach().double() / n
    else:
        with distributed.no_sync(run.forward_model, last=last):
            loss, nll_sum, n_tokens, n_correct = step_loss(run.task, run.forward_model, batch, device=ctx.device,
                                                           bf16=cfg.bf16, label_smoothing=cfg.label_smoothing)
            # Weighted by this rank's share of the tokens: the gradient average is the token-mean's.
            weight = distributed.token_share(n_tokens, ctx)  # () float64
            # A rank without counted tokens adds 0 (its loss is NaN, its gradients 0).
            counted = n_tokens > 0
            (torch.where(counted, loss * weight.to(loss.dtype), 0.0) / n).backward()
        share = torch.where(counted, loss.detach().double() * weight, 0.0) / ctx.world_size / n
    run.totals.add_batch(nll_sum, n_tokens, n_correct)
    return share


def _after_step(run: TrainingRun, stop: StopRequest, lr: float) -> bool:
    """Log, evaluate and save when due; whether to stop now (all ranks together)."""
    cfg, ctx, step = run.cfg, run.ctx, run.step
    at_row = step % cfg.log_every == 0 or step == run.total_steps
    stopping = False
    if not ctx.enabled:
        stopping = stop.requested
    elif at_row or step % run.save_every == 0:  # every rank reaches these steps together
        stopping = distributed.all_reduce_sum([stop.requested], ctx)[0] > 0
    if at_row:
        _log(run, lr)
    if step % run.eval_every == 0 or step == run.total_steps:
        _evaluate(run)
    if step % run.save_every == 0 or step == run.total_steps or stopping:
        _checkpoint(run)
    return stopping


def _log_row(run: TrainingRun, **row: Any) -> None:
    if run.metrics is not None:
        run.metrics.write(**row)


def _log(run: TrainingRun, lr: float) -> None:
    """A metrics row of the steps since the last one: the progress bar's and metrics.csv's."""
    _read_totals(run)
    window = run.window
    window.reduce(run.ctx)
    elapsed = time.perf_counter() - window.start
    mean_loss = window.loss / window.steps
    tokens_per_s = window.in_tokens / max(elapsed, 1e-9)
    run.bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", epoch=run.epoch)
    _log_row(run, step=run.step, epoch=run.epoch, lr=lr, train_loss=mean_loss,
             train_nll=window.nll / max(window.tokens, 1), train_acc=window.correct / max(window.tokens, 1),
             tokens_per_s=tokens_per_s, elapsed_s=time.perf_counter() - run.start_time)
    run.window = MetricsWindow()


def _evaluate(run: TrainingRun) -> None:
    _read_totals(run)
    val = run.task.evaluate(run.model, "val")
    run.last_val = (run.step, val)
    _log_row(run, step=run.step, epoch=run.epoch, val_nll=val["nll"], val_ppl=math.exp(min(val["nll"], 50)),
             val_acc=val["acc"], val_seq_acc=val["seq_acc"], val_bleu=val.get("bleu"),
             elapsed_s=time.perf_counter() - run.start_time)
    if run.ctx.is_main:
        run.bar.write(f"step {run.step}: val " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))


def _diverged(run: TrainingRun, what: str, at: int | None = None) -> TrainingDiverged:
    run.bar.close()
    at = run.step if at is None else at
    kept = run.location.nothing_saved() if run.saved_step is None else (
        f"nothing was saved after it: the latest checkpoint is still step-{run.saved_step:08d} in "
        f"{run.location.path / 'checkpoints'}")
    fix = ("a lower --lr" if run.cfg.clip_grad_norm is not None
           else "a lower --lr, or clip gradients with --clip-grad-norm")
    return TrainingDiverged(f"training diverged at step {at} ({what}); {kept}. Start again with {fix}", at)


def _read_totals(run: TrainingRun) -> None:
    """Fold the device's sums into the window (one sync) and stop if a step diverged."""
    bad = run.totals.fold(run.window)
    if bad is not None:
        at, loss, norm = bad
        clipping = run.cfg.clip_grad_norm is not None
        raise _diverged(run, f"loss {loss:.4g}" + (f", gradient norm {norm:.4g}" if clipping else ""), at)


def _checkpoint(run: TrainingRun) -> None:
    """Save weights, optimiser and position (never non-finite weights); a replacing run swaps in."""
    ctx, location, model, optimizer = run.ctx, run.location, run.model, run.optimizer
    _read_totals(run)  # the divergence guard first: a diverged step is named as such
    model_state = optimizer_state = None
    if ctx.fsdp:  # gather the full state on every rank (a collective); rank 0 writes it
        model_state, optimizer_state = distributed.full_state(model, optimizer, ctx)
    marks: dict[str, Any] = {}
    if run.adapters_only:  # what the run learned; its task loads the frozen base again
        marks["weights"] = ADAPTER_WEIGHTS
        model_state = {k: v for k, v in (model_state or model.state_dict()).items() if is_adapter_key(k)}
    # Never save non-finite weights (an overflow can reach them with the loss still finite).
    if not all_finite(model_state.values() if model_state is not None else model.parameters()):
        raise _diverged(run, "the weights hold NaN or infinite values")

    def save() -> None:
        save_checkpoint(location.path / "checkpoints", step=run.step, model=model, optimizer=optimizer,
                        keep=run.cfg.keep_checkpoints,
                        state={"epoch": run.epoch, "batch_in_epoch": run.batch_in_epoch,
                               "metrics_window": window_state, "elapsed_s": time.perf_counter() - run.start_time,
                               **marks},
                        model_state=model_state, optimizer_state=optimizer_state)
        location.swap_in()  # a replaced run: the new one takes its place once it holds a checkpoint

    window_state = run.window.saved(ctx)  # a collective: every rank, before rank 0 saves
    moving = location.pending
    distributed.run_on_main(ctx, save)
    run.saved_step = run.step
    if moving:  # every rank follows the run to its final place
        location.swapped()
        run.task.run_dir = location.path
        if run.metrics is not None:
            run.metrics.path = location.path / "metrics.csv"
