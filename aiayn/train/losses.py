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
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE, label_smoothing=label_smoothing)
    with torch.no_grad():
        nll_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE, reduction="sum")
        counted = targets != IGNORE
        correct = (logits.argmax(-1) == targets) & counted
        seq_correct = (correct | ~counted).all(dim=1)
    return LossOutput(loss=loss, nll_sum=nll_sum.detach(), n_tokens=int(counted.sum()),
                      n_correct=int(correct.sum()), n_seq_correct=int(seq_correct.sum()),
                      n_seqs=targets.shape[0])
