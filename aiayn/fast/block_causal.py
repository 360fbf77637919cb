"""Causal self-attention on the CPU in query blocks: only the lower-triangular blocks, each as large
batched products (PyTorch's flash kernel runs small tiles); their softmax weights are kept for the
backward, hence ``MAX_LENGTH`` and training only. Backward per block (rows r, keys [0, stop)):
dP = dO_r V^T, dS = P * (dP - rowsum(dO_r * O_r)), dQ_r = scale dS K, dK += scale dS^T Q_r, dV += P^T dO_r.

Shape letters: b batch, h heads, t positions, d_h head width, n = b h, r rows of a query block,
s = the keys a block sees."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from aiayn.fast import switch

BLOCK = 64  # queries per block: smaller ones gain nothing; larger ones compute more of the square
MAX_LENGTH = 1024  # longer: the kept weights grow as t^2 and the flash kernel's forward catches up
# Less work (b h t^2 d_h) than this: per-call overhead wins, SDPA is as fast or faster.
MIN_WORK = 1 << 22
# On one thread short sequences lose to SDPA (``python -m benchmarks.fast --threads 1,2``).
MIN_LENGTH_ONE_THREAD = 64


def use_block_causal(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
    """Whether ``block_causal_attention`` should run this square causal attention: a float32/64 CPU
    training forward, no GQA or dropout, between ``MIN_WORK`` and ``MAX_LENGTH``, not autocast or compiled."""
    b, h, t, d_h = q.shape
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and k.shape[1] == h
        and dropout_p == 0.0
        and 2 <= t <= MAX_LENGTH
        and (t >= MIN_LENGTH_ONE_THREAD or torch.get_num_threads() > 1)
        and b * h * t * t * d_h >= MIN_WORK
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and switch.enabled()
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


@cache
def _strictly_upper(r: int) -> Tensor:
    """(r, r) bool, True above the diagonal: the keys a block's queries may not see in its own block."""
    return torch.ones(r, r, dtype=torch.bool).triu_(1)


def _blocks(t: int) -> list[tuple[int, int]]:
    return [(start, min(start + BLOCK, t)) for start in range(0, t, BLOCK)]


def _forward(q: Tensor, k: Tensor, v: Tensor, scale: float,
             keep_weights: bool) -> tuple[Tensor, list[Tensor], tuple[Tensor, Tensor, Tensor]]:
    """q, k, v (b, h, t, d_h) -> (output (b, t, h, d_h), as the projection reads it; the blocks' softmax
    weights [(n, r, s)] if ``keep_weights``; q, k, v as (n, t, d_h))."""
    b, h, t, d_h = q.shape
    n = b * h
    q, k, v = (x.reshape(n, t, d_h) for x in (q, k, v))  # (n, t, d_h), copies of strided head views
    out = q.new_empty(b, t, h, d_h)
    weights: list[Tensor] = []
    for start, stop in _blocks(t):
        r = stop - start
        # (n, r, s) scores against every key up to the block's last query, scaled inside the product.
        scores = torch.baddbmm(q.new_empty(()), q[:, start:stop], k[:, :stop].transpose(1, 2),
                               beta=0, alpha=scale)
        scores[:, :, start:].masked_fill_(_strictly_upper(r), float("-inf"))
        p = torch.softmax(scores, dim=-1)  # every query sees its own key: no empty rows
        o = torch.bmm(p, v[:, :stop])  # (n, r, d_h)
        out[:, start:stop].copy_(o.view(b, h, r, d_h).transpose(1, 2))
        if keep_weights:
            weights.append(p)
    return out, weights, (q, k, v)


class _BlockCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        out, weights, flat = _forward(q, k, v, scale, keep_weights=True)
        ctx.scale = scale
        ctx.save_for_backward(*flat, out, *weights)  # q, k, v as (n, t, d_h): no second copy
        return out.transpose(1, 2)  # (b, h, t, d_h), a view of the (b, t, h, d_h) buffer

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, *weights = ctx.saved_tensors  # q, k, v (n, t, d_h); out (b, t, h, d_h)
        scale = ctx.scale
        b, t, h, d_h = out.shape
        n = b * h
        # rowsum(dO * O) = rowsum(P * dP) per query: the softmax backward's subtracted term.
        delta = (grad_out * out.transpose(1, 2)).sum(-1).reshape(n, t, 1)
        grad_out = grad_out.reshape(n, t, d_h)  # (n, t, d_h), a copy unless already in this layout
        grad_q = torch.empty_like(q)
        grad_k: list[Tensor | None] = [None] * len(weights)  # per key block, (n, r_j, d_h)
        grad_v: list[Tensor | None] = [None] * len(weights)
        for (start, stop), p in zip(_blocks(t), weights, strict=True):
            do = grad_out[:, start:stop]  # (n, r, d_h)
            ds = torch.bmm(do, v[:, :stop].transpose(1, 2))  # dP (n, r, s)
            ds.sub_(delta[:, start:stop]).mul_(p)  # dS = P * (dP - delta), unscaled
            grad_q[:, start:stop] = torch.baddbmm(q.new_empty(()), ds, k[:, :stop], beta=0, alpha=scale)
            for j, (key_start, key_stop) in enumerate(_blocks(stop)):
                p_j = p[:, :, key_start:key_stop].transpose(1, 2)  # (n, r_j, r)
                ds_j = ds[:, :, key_start:key_stop].transpose(1, 2)
                if grad_v[j] is None:  # the first (diagonal) visit of key block j
                    grad_v[j] = torch.bmm(p_j, do)
                    grad_k[j] = torch.baddbmm(q.new_empty(()), ds_j, q[:, start:stop], beta=0, alpha=scale)
                else:
                    grad_v[j].baddbmm_(p_j, do)
                    grad_k[j].baddbmm_(ds_j, q[:, start:stop], alpha=scale)
        shape = (b, h, t, d_h)
        return grad_q.view(shape), torch.cat(grad_k, 1).view(shape), torch.cat(grad_v, 1).view(shape), None


def block_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)``, q, k, v (b, h, t, d_h)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _BlockCausalAttention.apply(q, k, v, scale)
    out, _, _ = _forward(q, k, v, scale, keep_weights=False)
    return out.transpose(1, 2)
