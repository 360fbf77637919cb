"""Cross-entropy with label smoothing, the true NLL beside it, and accuracy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE = -100  # target value of positions that do not count (padding)


@dataclass
class LossOutput:
    loss: Tensor  # scalar, smoothed cross-entropy averaged over counted positions (backprop this)
    nll_sum: Tensor  # scalar, summed true negative log-likelihood (no smoothing), detached
    n_tokens: int  # counted positions
    n_correct: int  # counted positions whose argmax equals the target
    n_seq_correct: int  # sequences whose counted positions are all correct
    n_seqs: int


def sequence_loss(logits: Tensor, targets: Tensor, *, label_smoothing: float = 0.0) -> LossOutput:
    """logits (b, t, c), targets (b, t) with ``IGNORE`` at padding.

    Label smoothing (paper section 5.4) puts ``eps / c`` of the target mass on every class; the
    reported NLL is the plain cross-entropy, so perplexity = exp(nll_sum / n_tokens).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree "
                         f"in their leading (batch, seq) dimensions")
    flat_targets = targets.reshape(-1)  # (n,)
    counted_flat = flat_targets != IGNORE
    # One log-softmax serves the smoothed loss and the true NLL (it is the costliest op after the
    # matmuls at an 8k vocabulary). Equal to F.cross_entropy(label_smoothing=eps):
    # (1 - eps) * -log p(target) + eps * mean over classes of -log p(class).
    log_probs = F.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)  # (n, c)
    safe_targets = flat_targets.masked_fill(~counted_flat, 0)
    token_nll = -log_probs.gather(1, safe_targets[:, None]).squeeze(1)  # (n,)
    per_token = token_nll if label_smoothing == 0 else (
        (1 - label_smoothing) * token_nll - label_smoothing * log_probs.mean(dim=-1))
    n_counted = counted_flat.sum()
    loss = (per_token * counted_flat).sum() / n_counted  # NaN with nothing counted, as F.cross_entropy
    with torch.no_grad():
        nll_sum = (token_nll * counted_flat).sum()
        counted = targets != IGNORE
        correct = (logits.argmax(-1) == targets) & counted
        seq_correct = (correct | ~counted).all(dim=1)
    return LossOutput(loss=loss, nll_sum=nll_sum.detach(), n_tokens=int(counted.sum()),
                      n_correct=int(correct.sum()), n_seq_correct=int(seq_correct.sum()),
                      n_seqs=targets.shape[0])
