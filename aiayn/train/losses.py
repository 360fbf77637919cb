"""Cross-entropy with label smoothing, the true NLL and accuracy; fused with an output layer that offers it
(``aiayn.fast``), so the (n, v) logits never exist."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.models.base import ModelOutput
from aiayn.nn.packing import Packing

IGNORE = -100  # target value of positions that do not count (padding)

LossInput = Tensor | ModelOutput  # what sequence_loss takes: logits (b, t, c), or a model's output


@dataclass
class LossOutput:
    """The loss and its counts, 0-dim tensors on the loss's device (reading one is a host sync)."""

    loss: Tensor  # scalar, smoothed cross-entropy averaged over counted positions (backprop this)
    nll_sum: Tensor  # scalar, summed true negative log-likelihood (no smoothing), detached
    n_tokens: Tensor  # () long: counted positions
    n_correct: Tensor  # () long: counted positions whose argmax equals the target
    n_seq_correct: Tensor  # () long: sequences whose counted positions are all correct
    n_seqs: int


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Label-smoothed cross-entropy with row weights and the true row NLL from one log-softmax; backward
    ``(softmax - q) * weight`` in one pass."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, weights: Tensor,
                label_smoothing: float) -> tuple[Tensor, Tensor]:
        # logits (n, c) any float dtype; targets (n,) valid class ids; weights (n,) float32
        log_probs = F.log_softmax(logits.float(), dim=-1)  # (n, c) float32
        token_nll = -log_probs.gather(1, targets[:, None]).squeeze(1)  # (n,)
        per_token = token_nll if label_smoothing == 0 else (
            (1 - label_smoothing) * token_nll - label_smoothing * log_probs.mean(dim=-1))
        ctx.save_for_backward(log_probs, targets, weights)
        ctx.label_smoothing, ctx.logits_dtype = label_smoothing, logits.dtype
        ctx.mark_non_differentiable(token_nll)
        return (per_token * weights).sum(), token_nll

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        log_probs, targets, weights = ctx.saved_tensors
        eps, n_classes = ctx.label_smoothing, log_probs.shape[1]
        row_scale = (weights * grad_loss)[:, None]  # (n, 1)
        grad = log_probs.exp()  # softmax (n, c), a fresh buffer updated in place below
        if eps:
            grad.sub_(eps / n_classes)
        grad.scatter_add_(1, targets[:, None], torch.full_like(row_scale, -(1 - eps)))
        grad.mul_(row_scale)
        return grad.to(ctx.logits_dtype), None, None, None


def sequence_loss(out: LossInput, targets: Tensor, *, label_smoothing: float = 0.0) -> LossOutput:
    """logits (b, t, c) or a model's output against targets (b, t), ``IGNORE`` at padding: as
    ``F.cross_entropy(label_smoothing=eps, ignore_index=IGNORE)``, the NLL unsmoothed."""
    if isinstance(out, Tensor):
        if out.shape[:-1] != targets.shape:
            raise ValueError(f"logits {tuple(out.shape)} and targets {tuple(targets.shape)} disagree "
                             f"in their leading (batch, seq) dimensions")
        rows, flat_targets = out.reshape(-1, out.shape[-1]), targets.reshape(-1)  # (n, c), (n,)
        return _loss_output(*_logits_loss(rows, flat_targets, label_smoothing), flat_targets, targets, None)
    packing = out.packing
    hidden = out.hidden_rows.reshape(-1, out.hidden_rows.shape[-1])  # (n, d): every position, or the real ones
    batch_shape = (packing.batch, packing.length) if packing is not None else tuple(out.hidden_rows.shape[:2])
    if tuple(targets.shape) != batch_shape:
        raise ValueError(f"targets must have the (batch, seq) shape of the model's input, {batch_shape}; "
                         f"got {tuple(targets.shape)}")
    flat_targets = packing.pack(targets) if packing is not None else targets.reshape(-1)  # (n,)
    kept = _counted_rows(hidden, flat_targets)
    if kept is None:
        loss, token_nll, predictions = _head_loss(out.head, hidden, flat_targets, label_smoothing)
    else:  # the output layer runs on the counted rows only; the per-row results go back in place
        loss, kept_nll, kept_predictions = _head_loss(out.head, hidden.index_select(0, kept),
                                                      flat_targets.index_select(0, kept), label_smoothing)
        token_nll = kept_nll.new_zeros(flat_targets.shape).index_copy_(0, kept, kept_nll)
        predictions = kept_predictions.new_full(flat_targets.shape, -1).index_copy_(0, kept, kept_predictions)
    return _loss_output(loss, token_nll, predictions, flat_targets, targets, packing)


def _counted_rows(hidden: Tensor, flat_targets: Tensor) -> Tensor | None:
    """The indices of the rows whose targets count, where leaving out the others saves the output layer's
    work (a chat example's prompt, padding): on the CPU, outside ``torch.compile``, when some rows do not
    count. None: every row. (On a GPU the row count would make the host wait for the device.)"""
    if hidden.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    counted = flat_targets != IGNORE
    kept = int(counted.sum())
    return None if kept in (0, counted.numel()) else counted.nonzero().squeeze(1)


def _head_loss(head: Any, hidden: Tensor, flat_targets: Tensor,
               label_smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, per-row NLL, per-row predictions) of the output layer ``head`` on ``hidden`` (n, d)."""
    fused = getattr(head, "cross_entropy", None)  # aiayn.fast's output layer + loss in one
    result = fused(hidden, flat_targets, ignore_index=IGNORE) if fused is not None else None
    if result is None:
        return _logits_loss(head(hidden), flat_targets, label_smoothing)
    # Both sums are already averaged over the counted rows (aiayn.fast.fused_loss).
    loss = result.nll_sum if label_smoothing == 0 else (
        (1 - label_smoothing) * result.nll_sum + label_smoothing * result.uniform_sum)
    return loss, result.token_nll, result.predictions


def _logits_loss(rows: Tensor, flat_targets: Tensor, label_smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, per-row NLL, per-row predictions) of logit rows (n, c) against their targets (n,)."""
    counted_flat = flat_targets != IGNORE
    safe_targets = flat_targets.masked_fill(~counted_flat, 0)
    weights = counted_flat.float() / counted_flat.sum().clamp(min=1)  # all 0 with nothing counted
    loss, token_nll = _SmoothedCrossEntropy.apply(rows, safe_targets, weights, label_smoothing)
    return loss, token_nll, rows.detach().argmax(-1)


def _loss_output(loss: Tensor, token_nll: Tensor, predictions: Tensor, flat_targets: Tensor, targets: Tensor,
                 packing: Packing | None) -> LossOutput:
    """The loss with its counts over the computed rows; targets (b, t)."""
    counted = targets != IGNORE  # (b, t)
    counted_flat = flat_targets != IGNORE  # (n,)
    n_tokens = counted.sum()
    # A padding-free forward is eager on the CPU only (``aiayn.nn.data_checks.reads_data``): checked there.
    if packing is not None and int(n_tokens) != int(counted_flat.sum()):
        raise ValueError("targets count positions the padding-free forward skipped (padded inputs); "
                         f"set those targets to IGNORE ({IGNORE}) or mark the inputs valid")
    # NaN with nothing counted, as F.cross_entropy, and zero gradients; chosen on the device.
    loss = torch.where(counted_flat.any(), loss, loss + float("nan"))
    with torch.no_grad():
        nll_sum = (token_nll * counted_flat).sum()
        correct_flat = (predictions == flat_targets) & counted_flat  # (n,)
        correct = packing.unpack(correct_flat) if packing is not None else correct_flat.view(targets.shape)
        seq_correct = (correct | ~counted).all(dim=1)
    return LossOutput(loss=loss, nll_sum=nll_sum.detach(), n_tokens=n_tokens,
                      n_correct=correct.sum(), n_seq_correct=seq_correct.sum(),
                      n_seqs=targets.shape[0])
