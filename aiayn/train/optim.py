"""Optimisers and learning-rate schedules, pure functions of the (1-based) step: a resume needs no state."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from aiayn.config import TrainConfig


def noam_lr(step: int, *, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The paper's schedule (section 5.3): factor * d^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cosine_lr(step: int, *, peak: float, warmup: int, total: int) -> float:
    """Linear warmup to ``peak`` then half a cosine to 0 at ``total`` (UvA tutorial formula)."""
    factor = 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    if warmup > 0 and step <= warmup:
        factor *= step / warmup
    return peak * factor


def linear_lr(step: int, *, peak: float, warmup: int, total: int) -> float:
    """Linear warmup to ``peak`` then linear decay to 0 at ``total``."""
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    return peak * max(0.0, (total - step) / max(1, total - warmup))


def constant_lr(step: int, *, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak``, then constant."""
    return peak * (step / warmup if warmup > 0 and step <= warmup else 1.0)


def make_schedule(cfg: TrainConfig, *, total_steps: int, d_model: int) -> Callable[[int], float]:
    """The learning rate of each (1-based) optimiser step."""
    if cfg.schedule == "noam":
        return lambda s: noam_lr(s, d_model=d_model, warmup=cfg.warmup_steps, factor=cfg.lr)
    if cfg.schedule == "cosine":
        return lambda s: cosine_lr(s, peak=cfg.lr, warmup=cfg.warmup_steps, total=total_steps)
    if cfg.schedule == "linear":
        return lambda s: linear_lr(s, peak=cfg.lr, warmup=cfg.warmup_steps, total=total_steps)
    return lambda s: constant_lr(s, peak=cfg.lr, warmup=cfg.warmup_steps)


NOAM_TINY_PEAK = 1e-5  # a Noam schedule whose peak learning rate is below this learns nothing


def schedule_warning(cfg: TrainConfig, *, d_model: int) -> str | None:
    """A warning for a schedule that cannot learn: Noam with a factor that makes its peak tiny."""
    if cfg.schedule != "noam":
        return None
    peak = noam_lr(cfg.warmup_steps, d_model=d_model, warmup=cfg.warmup_steps, factor=cfg.lr)
    if peak >= NOAM_TINY_PEAK:
        return None
    return (f"warning: schedule noam with lr (its factor) {cfg.lr:g} peaks at a learning rate of "
            f"{peak:.2g} at step {cfg.warmup_steps}, too small to learn; the paper's factor is 1 (--lr 1)")


def warmup_warning(cfg: TrainConfig, *, total_steps: int, d_model: int) -> str | None:
    """A warning for a run shorter than its warm-up (the learning rate never reaches its peak)."""
    if total_steps >= cfg.warmup_steps:
        return None
    schedule = make_schedule(cfg, total_steps=total_steps, d_model=d_model)
    peak = noam_lr(cfg.warmup_steps, d_model=d_model, warmup=cfg.warmup_steps, factor=cfg.lr) \
        if cfg.schedule == "noam" else cfg.lr
    # The highest rate the run does reach (cosine decays while still warming up).
    reached = max(schedule(s) for s in range(1, total_steps + 1))
    return (f"warning: the run's {total_steps} steps are fewer than its {cfg.warmup_steps} warm-up steps: the "
            f"learning rate never reaches its peak {peak:.3g} (at most {reached:.3g}); give --warmup-steps "
            f"{max(1, total_steps // 10)} (a tenth of the run) or train longer")


def parameter_groups(model: nn.Module, weight_decay: float, *, decay_all: bool = False) -> list[dict]:
    """Decay matrices of linear layers; not norms, biases or embeddings (unless ``decay_all``)."""
    no_decay: set[int] = set()
    if not decay_all:
        for module in model.modules():
            if isinstance(module, nn.Embedding | nn.LayerNorm | nn.RMSNorm):
                no_decay.update(id(p) for p in module.parameters(recurse=False))
        no_decay.update(id(p) for p in model.parameters() if p.dim() < 2)  # biases, gains
    decay, keep = [], []
    for p in model.parameters():  # each parameter once, tied weights included
        if p.requires_grad:
            (keep if id(p) in no_decay else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if keep:
        groups.append({"params": keep, "weight_decay": 0.0})
    return groups


def make_optimizer(model: nn.Module, cfg: TrainConfig, *, fused: bool = False) -> torch.optim.Optimizer:
    """Adam or AdamW over the trainable parameters; ``fused``: one kernel (CUDA). Beside a frozen base (LoRA's
    many small adapters) the multi-tensor step; a whole model the per-tensor one (smaller temporaries)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    kind = {"fused": True} if fused else {"foreach": True} if frozen else {}
    if cfg.optimizer == "adam":
        return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, **kind)
    groups = parameter_groups(model, cfg.weight_decay, decay_all=cfg.decay_all)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **kind)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` keeping this optimizer's implementation (fused or not)."""
    kinds = [{key: group.get(key) for key in ("fused", "foreach", "capturable")} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kind in zip(optimizer.param_groups, kinds, strict=True):
        group.update(kind)


def clip_and_measure(parameters: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor | None:
    """Clip the gradients' total 2-norm to ``max_norm``; the norm before (0-dim, on the device) or None."""
    if max_norm is None:
        return None
    total = nn.utils.clip_grad_norm_(parameters, max_norm)
    if hasattr(total, "full_tensor"):  # FSDP2: a sharded DTensor; every rank gets the global norm
        total = total.full_tensor()
    return total.detach()


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no floating-point tensor holds NaN or an infinity."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
