"""metrics.csv (``MetricsLog``), the steps since its last row (``MetricsWindow``), their device sums."""

from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.train import distributed

METRIC_FIELDS = ["step", "epoch", "lr", "train_loss", "train_nll", "train_acc", "tokens_per_s",
                 "val_nll", "val_ppl", "val_acc", "val_seq_acc", "val_bleu", "elapsed_s"]


class MetricsLog:
    """metrics.csv, one row per log or evaluation; on resume rows after the checkpoint are dropped."""

    def __init__(self, path: Path, *, resume_step: int | None) -> None:
        self.path = path
        rows: list[dict[str, str]] = []
        if resume_step is not None and path.is_file():
            with open(path, newline="", encoding="utf-8") as handle:
                rows = [r for r in csv.DictReader(handle) if int(r["step"]) <= resume_step]
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=METRIC_FIELDS)
            writer.writeheader()
            writer.writerows(rows)

    def write(self, **row: Any) -> None:
        with open(self.path, "a", newline="", encoding="utf-8") as handle:
            row = {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()}
            csv.DictWriter(handle, fieldnames=METRIC_FIELDS).writerow(row)


@dataclass
class MetricsWindow:
    """The statistics since the last metrics.csv row, saved in a checkpoint for exact resume."""

    loss: float = 0.0  # sum of the steps' losses (the union's, in a distributed run)
    steps: int = 0
    nll: float = 0.0  # summed over this rank's target tokens
    tokens: float = 0  # target tokens (a float once summed over ranks)
    correct: float = 0  # target tokens predicted right
    in_tokens: float = 0  # input tokens since ``start``, for tokens/s (not saved: a rate of this process)
    start: float = field(default_factory=time.perf_counter)

    PER_RANK = ("nll", "tokens", "correct", "in_tokens")  # this rank's counts, summed over ranks per row
    SAVED = ("loss", "steps", "nll", "tokens", "correct")

    def reduce(self, ctx: distributed.DistContext) -> None:
        """Sum the per-rank counts over all ranks (a collective) into every rank's window."""
        if ctx.enabled:
            summed = distributed.all_reduce_sum([getattr(self, name) for name in self.PER_RANK], ctx)
            for name, value in zip(self.PER_RANK, summed, strict=True):
                setattr(self, name, value)

    def saved(self, ctx: distributed.DistContext) -> dict[str, float]:
        """The window for a checkpoint (a collective): the union's counts, kept by rank 0."""
        self.reduce(ctx)
        state = {name: getattr(self, name) for name in self.SAVED}
        if not ctx.is_main:
            for name in self.PER_RANK:
                setattr(self, name, 0)
        return state

    @classmethod
    def restored(cls, state: dict[str, Any], ctx: distributed.DistContext) -> MetricsWindow:
        """The window a checkpoint saved."""

        def number(name: str) -> float:  # state.json is a file: anything but a finite number counts 0
            value = state.get(name, 0) if isinstance(state, dict) else 0
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            return value if ok else 0

        window = cls()
        for name in cls.SAVED:  # the union's counts go to rank 0 only, as saved() left them
            if ctx.is_main or name not in cls.PER_RANK:
                setattr(window, name, number(name))
        window.steps = int(window.steps)
        return window


class DeviceTotals:
    """The statistics since the last ``fold``, summed on the device, and the first non-finite step."""

    def __init__(self, device: torch.device) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.loss, self.nll = zero.clone(), zero.clone()  # sum of step losses; summed true NLL
        self.tokens = torch.zeros((), dtype=torch.long, device=device)
        self.correct = torch.zeros((), dtype=torch.long, device=device)
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)  # -1: none yet
        self.bad_loss, self.bad_norm = zero.clone(), zero.clone()

    def add_batch(self, nll_sum: Tensor, n_tokens: Tensor, n_correct: Tensor) -> None:
        self.nll += nll_sum.double()
        self.tokens += n_tokens
        self.correct += n_correct

    def add_step(self, step: int, loss: Tensor, grad_norm: Tensor | None) -> None:
        """One optimiser step's loss (and clipped gradient norm): summed, and watched for NaN/inf."""
        loss = loss.double()
        norm = torch.zeros_like(loss) if grad_norm is None else grad_norm.double()
        first = ~(torch.isfinite(loss) & torch.isfinite(norm)) & (self.bad_step < 0)
        self.bad_step = torch.where(first, step, self.bad_step)
        self.bad_loss = torch.where(first, loss, self.bad_loss)
        self.bad_norm = torch.where(first, norm, self.bad_norm)
        self.loss += loss

    def fold(self, window: MetricsWindow) -> tuple[int, float, float] | None:
        """Move the sums into ``window`` (one read); the first non-finite (step, loss, norm) or None."""
        loss, nll, tokens, correct, bad_step, bad_loss, bad_norm = torch.stack([
            self.loss, self.nll, self.tokens.double(), self.correct.double(), self.bad_step.double(),
            self.bad_loss, self.bad_norm]).tolist()
        window.loss += loss
        window.nll += nll
        window.tokens += int(tokens)
        window.correct += int(correct)
        for total in (self.loss, self.nll, self.tokens, self.correct):
            total.zero_()
        self.bad_step.fill_(-1)
        return (int(bad_step), bad_loss, bad_norm) if bad_step >= 0 else None
