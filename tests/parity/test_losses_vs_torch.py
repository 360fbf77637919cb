"""sequence_loss against torch.nn.functional.cross_entropy: value and gradient, with padding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.train.losses import IGNORE, sequence_loss


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_smoothed_loss_and_nll_equal_torch(eps, device):
    g = torch.Generator().manual_seed(0)  # drawn on the CPU: the same numbers on every device
    logits = torch.randn(3, 7, 99, generator=g, dtype=torch.float64).to(device).requires_grad_()
    targets = torch.randint(0, 99, (3, 7), generator=g).to(device)
    targets[0, 5:] = IGNORE
    targets[2, 1:] = IGNORE
    out = sequence_loss(logits, targets, label_smoothing=eps)
    (grad,) = torch.autograd.grad(out.loss, logits)
    flat = logits.reshape(-1, 99).float()
    expected = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE, label_smoothing=eps)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    nll = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(out.nll_sum, nll.detach())
    assert out.n_tokens == int((targets != IGNORE).sum()) == 7 + 5 + 1
    counted = targets != IGNORE
    correct = (logits.argmax(-1) == targets) & counted
    assert out.n_correct == int(correct.sum())
