"""The output layer and the cross-entropy fused, chunk by chunk: the (n, v) logits never exist.

Each chunk of rows (~16 MB of logits) becomes its softmax and is multiplied into the gradients of
h and W at once (Liger Kernel's, Cut Cross-Entropy's approach). Label smoothing is the caller's:
``nll_sum = sum_i w_i (lse_i - z_i[t_i])``, ``uniform_sum = sum_i w_i (lse_i - mean_j z_ij)``. With
incoming scales g1, g2 the logits' gradient is ``(g1 + g2) w_i (p_i - e_{t_i}) + g2 w_i e_{t_i} -
g2 w_i / v``: the forward computes the first term's ``P_h = G W``, ``P_W = G^T h``; the backward the rest.

Shape letters: n rows (tokens), d model width, v vocabulary, c rows in a chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from aiayn.fast import onednn
from aiayn.fast.linear import FastLinear

CHUNK_ELEMENTS = 1 << 22  # logits per chunk (16 MB in float32): in the L3 cache, big matmuls
# ...but never fewer rows than this: on fewer, the matmuls lose more than the cache saves.
MIN_CHUNK_ROWS = 256


@dataclass
class HeadLoss:
    """A fused output layer + cross-entropy over n rows (``aiayn.train.losses.sequence_loss``): the
    differentiable ``nll_sum``, ``uniform_sum`` (rows weighted 1 / counted rows), and the rest per row."""

    nll_sum: Tensor
    uniform_sum: Tensor
    token_nll: Tensor
    predictions: Tensor
    targets: Tensor


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The matmuls' dtype: the autocast one when autocast is on (as ``nn.Linear``'s)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def rows_per_chunk(n_classes: int) -> int:
    """How many rows of logits one chunk of ``linear_cross_entropy`` holds."""
    return max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // max(n_classes, 1))


ARGMAX_BLOCK = 64


def _max_and_argmax(z: Tensor) -> tuple[Tensor, Tensor]:
    """``z.max(dim=1)`` of a (c, v) chunk, faster on the CPU: a vectorised amax per block, then the index
    searched in the first block holding the max."""
    c, v = z.shape
    n_blocks = v // ARGMAX_BLOCK
    if n_blocks < 2:
        return z.max(dim=1)
    blocks = z[:, : n_blocks * ARGMAX_BLOCK].unflatten(1, (n_blocks, ARGMAX_BLOCK))  # (c, nb, blk) view
    top, block = blocks.amax(dim=2).max(dim=1)  # (c,), (c,): the first block holding the max
    inside = blocks.gather(1, block[:, None, None].expand(c, 1, ARGMAX_BLOCK)).squeeze(1).argmax(dim=1)
    ids = block * ARGMAX_BLOCK + inside
    if n_blocks * ARGMAX_BLOCK < v:  # the last, partial block: it wins only on a strictly larger max
        rest_top, rest_ids = z[:, n_blocks * ARGMAX_BLOCK:].max(dim=1)
        later = rest_top > top
        top, ids = torch.where(later, rest_top, top), torch.where(later, rest_ids + n_blocks * ARGMAX_BLOCK, ids)
    return top, ids


def _transpose(m: Tensor, block: int = 256) -> Tensor:
    """m (d, v) -> a contiguous (v, d) copy, ``block`` columns at a time (cache-friendly for a wide m)."""
    out = m.new_empty(m.shape[1], m.shape[0])
    for start in range(0, m.shape[1], block):
        out[start:start + block].copy_(m[:, start:start + block].t())
    return out


def _head_loss_rows(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, weights: Tensor,
                    chunk_rows: int, grads: tuple[bool, bool, bool]) -> tuple[Tensor, ...]:
    """The forward and, for ``grads`` (hidden, weight, bias), the softmax part of the gradients -> nll,
    uniform, predictions (n,), P_h (n, d), P_W (v, d), P_b (v,) (None where not asked for)."""
    dtype = _compute_dtype(hidden)
    h, w_t = hidden.to(dtype), weight.to(dtype).t()  # (n, d), (d, v)
    b = bias.to(dtype) if bias is not None else None
    n = h.shape[0]
    # float32 on the CPU: the three products through oneDNN (aiayn.fast.onednn), faster than MKL's.
    fast = onednn.use_onednn(h, weight)
    nll, uniform = h.new_empty(n, dtype=torch.float32), h.new_empty(n, dtype=torch.float32)
    predictions = targets.new_empty(n)
    p_h = h.new_empty(n, h.shape[1], dtype=torch.float32) if grads[0] else None
    p_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads[1] and not fast else None
    p_w_t = None  # the fast path's P_W^T (d, v): oneDNN has no accumulating product; x^T g runs faster
    p_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if grads[2] else None
    for start in range(0, n, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n))
        h_c = h[rows]  # (c, d)
        if fast:
            z = onednn.linear_product(h_c, weight, b)  # (c, v) logits
        else:
            z = (torch.addmm(b, h_c, w_t) if b is not None else h_c @ w_t).float()
        # The log-sum-exp comes from the softmax at the argmax: p = exp(max - lse) >= 1 / v.
        top, top_ids = _max_and_argmax(z)  # (c,), (c,)
        predictions[rows] = top_ids
        target_logit, mean_logit = z.gather(1, targets[rows, None]).squeeze(1), z.mean(dim=1)
        z = torch.softmax(z, dim=1)  # (c, v)
        lse = top - z.gather(1, top_ids[:, None]).squeeze(1).log()
        nll[rows], uniform[rows] = lse - target_logit, lse - mean_logit
        if not any(grads):
            continue
        # z becomes w_i (softmax_i - e_{t_i}): scaled by w_i, then -w_i at the target.
        z.mul_(weights[rows, None])
        z.scatter_add_(1, targets[rows, None], -weights[rows, None])
        g = z.to(dtype)  # (c, v), a no-op in float32
        if fast:
            if p_h is not None:
                p_h[rows] = onednn.linear_product(g, weight.t())  # (c, d) = G W
            if grads[1]:
                part = onednn.linear_product(h_c.t(), g.t())  # (d, v) = h^T G
                p_w_t = part if p_w_t is None else p_w_t.add_(part)
        elif p_h is not None:
            p_h[rows] = g @ w_t.t()  # (c, d)
        if p_w is not None:
            if g.dtype == torch.float32 and h_c.dtype == torch.float32:
                # (v, d) += (v, c) @ (c, d); out= rather than addmm_, which FlopCounterMode misses
                torch.addmm(p_w, g.t(), h_c, out=p_w)
            else:
                p_w += (g.t() @ h_c).float()
        if p_b is not None:
            p_b += z.sum(dim=0)
    if fast and grads[1]:
        p_w = _transpose(p_w_t) if p_w_t is not None else torch.zeros_like(weight)  # (v, d)
    return nll, uniform, predictions, p_h, p_w, p_b


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                weights: Tensor, chunk_rows: int) -> tuple[Tensor, ...]:
        grads = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        nll, uniform, predictions, p_h, p_w, p_b = _head_loss_rows(
            hidden, weight, bias, targets, weights, chunk_rows, grads)
        ctx.save_for_backward(hidden, weight, targets, weights, p_h, p_w, p_b)
        ctx.grads, ctx.hidden_dtype, ctx.weight_dtype = grads, hidden.dtype, weight.dtype
        ctx.compute_dtype = _compute_dtype(hidden)
        ctx.mark_non_differentiable(nll, predictions)
        return (weights * nll).sum(), (weights * uniform).sum(), nll, predictions

    @staticmethod
    def backward(ctx: Any, g_nll: Tensor, g_uniform: Tensor, _g_rows: Tensor,
                 _g_pred: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, weights, p_h, p_w, p_b = ctx.saved_tensors
        need_h, need_w, need_b = ctx.grads
        n_classes = weight.shape[0]
        scale = g_nll + g_uniform  # of the softmax part
        w = weights[:, None]  # (n, 1)
        grad_h = grad_w = grad_b = None
        if need_h:
            w_c = weight.to(ctx.compute_dtype).float()  # the weights the forward multiplied by
            # (n, d): (g1 + g2) P_h + g2 w_i W[t_i] - g2 w_i mean_j W_j
            grad_h = scale * p_h + g_uniform * w * (w_c.index_select(0, targets) - w_c.mean(dim=0))
            grad_h = grad_h.to(ctx.hidden_dtype)
        if need_w:
            h_c = hidden.to(ctx.compute_dtype).float()
            # (v, d): (g1 + g2) P_W - g2 / v sum_i w_i h_i + g2 sum_i w_i e_{t_i} h_i^T, in one pass
            weighted = (g_uniform * w) * h_c  # (n, d)
            grad_w = torch.add(weighted.sum(dim=0) / -n_classes, p_w, alpha=float(scale))
            grad_w = grad_w.index_add_(0, targets, weighted).to(ctx.weight_dtype)
        if need_b:
            one_hot_b = torch.zeros_like(p_b).index_add_(0, targets, weights)
            grad_b = (scale * p_b + g_uniform * (one_hot_b - weights.sum() / n_classes)).to(ctx.weight_dtype)
        return grad_h, grad_w, grad_b, None, None, None


# Eager inside a compiled model, through torch's lazy disable (torch._dynamo imported at first call).
@torch._disable_dynamo
def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, *,
                         ignore_index: int = -100, chunk_rows: int | None = None) -> HeadLoss:
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` (n, v), never materialised, against
    ``targets`` (n,), weighted as ``F.cross_entropy``'s mean (nothing counted: 0, not NaN)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (n, d) and weight (v, d) must share d; got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class ids, got dtype {targets.dtype}")
    targets = targets.long()
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must have shape ({hidden.shape[0]},) (one per hidden row), "
                         f"got {tuple(targets.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    counted = targets != ignore_index  # (n,)
    bad = counted & ((targets < 0) | (targets >= weight.shape[0]))
    if bool(bad.any()):
        raise ValueError(f"targets hold ids outside [0, {weight.shape[0]}) (e.g. {int(targets[bad][0])}); "
                         f"mark positions that do not count with {ignore_index}")
    weights = counted.float() / counted.sum().clamp(min=1)  # (n,) all 0 when nothing counts
    safe_targets = targets.masked_fill(~counted, 0)
    chunk = chunk_rows if chunk_rows is not None else rows_per_chunk(weight.shape[0])
    inputs_need_grad = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and inputs_need_grad:
        nll_sum, uniform_sum, nll, predictions = _LinearCrossEntropy.apply(
            hidden, weight, bias, safe_targets, weights, chunk)
    else:
        nll, uniform, predictions, *_ = _head_loss_rows(hidden, weight, bias, safe_targets, weights, chunk,
                                                        (False, False, False))
        nll_sum, uniform_sum = (weights * nll).sum(), (weights * uniform).sum()
    return HeadLoss(nll_sum=nll_sum, uniform_sum=uniform_sum, token_nll=nll, predictions=predictions,
                    targets=targets)


class FusedLossLinear(FastLinear):
    """A training model's output layer: a ``FastLinear`` whose ``cross_entropy`` (which
    ``aiayn.train.losses.sequence_loss`` looks for) runs it fused with the loss."""

    def cross_entropy(self, hidden: Tensor, targets: Tensor, *, ignore_index: int) -> HeadLoss | None:
        """hidden (n, d), targets (n,) -> the fused loss, or None (the caller computes logits) for a weight
        that is not a plain tensor or inside ``torch.compile`` (Inductor fuses the plain pair)."""
        if type(self.weight.data) is not Tensor or torch.compiler.is_compiling():
            return None
        return linear_cross_entropy(hidden, self.weight, self.bias, targets, ignore_index=ignore_index)
