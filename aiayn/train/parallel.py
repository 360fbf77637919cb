"""Tensor parallelism (Megatron-style) of attention heads and feed-forward, via ``torch.distributed.tensor``.

Each ``TransformerBlock`` is split over a 1-D device mesh of ``tp`` ranks:

* attention: the q/k/v projection column-wise (rank r computes heads r*h/tp .. (r+1)*h/tp - 1 and
  their key/value heads), the output projection row-wise (partial sums all-reduced). The module's
  head counts become the local ones (``n_heads / tp``, ``n_kv_heads / tp``), so its reshapes and
  the attention kernel run unchanged on the local heads;
* feed-forward: ``fc_in`` column-wise, ``fc_out`` row-wise.

Embeddings, norms and the output projection stay replicated: every rank sees the full hidden
state between blocks (one all-reduce after attention, one after the feed-forward).

aiayn fuses q, k and v into one matrix (and a gated unit's gate and value into one), while
``ColwiseParallel`` gives rank r the r-th contiguous block of output rows. So the rows are first
reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], rank r's block holding its heads' q, k and v.
The model's state dict is then in that reordered, sharded layout: parallelise a model for
forward/backward after loading its weights, and save weights from an unparallelised copy.

Limits (checked, with a message): heads, kv heads and d_ff divisible by tp; positional schemes
with per-head biases (ALiBi, T5) are not split (their bias is built for all heads); no KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from aiayn.models.blocks import TransformerBlock
from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.mlp import FeedForward


class TensorParallelError(ValueError):
    """A model that cannot be split over the asked number of ranks."""


def _interleave_rows(linear: nn.Linear, sizes: list[int], tp: int) -> None:
    """Reorder the output rows of a fused projection [A | B | ...] (sizes of each part) to
    [A_0 B_0 ... | A_1 B_1 ... | ...], where X_r is the r-th of tp equal slices of part X."""
    index, offset = [], 0
    starts = []
    for size in sizes:
        starts.append(offset)
        offset += size
    for r in range(tp):
        for start, size in zip(starts, sizes, strict=True):
            part = size // tp
            index.append(torch.arange(start + r * part, start + (r + 1) * part))
    order = torch.cat(index)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise ``TensorParallelError`` if ``model`` cannot be split over ``tp`` ranks."""
    config = getattr(model, "config", None)
    if config is not None and config.positional in ("alibi", "t5"):
        raise TensorParallelError(f"tensor parallelism does not split the per-head {config.positional} "
                                  f"bias yet; use rope, sinusoidal or learned positions")
    for name, module in model.named_modules():
        if isinstance(module, MultiHeadAttention):
            if module.n_heads % tp or module.n_kv_heads % tp:
                raise TensorParallelError(
                    f"{name}: {module.n_heads} heads / {module.n_kv_heads} kv heads are not divisible by "
                    f"tp={tp}; choose a tp that divides both")
        elif isinstance(module, FeedForward) and module.fc_out.in_features % tp:
            raise TensorParallelError(f"{name}: d_ff={module.fc_out.in_features} is not divisible by tp={tp}")


def tensor_parallel_plan(block: TransformerBlock, tp: int) -> dict[str, object]:
    """The ``parallelize_module`` plan of one block (reorders its fused projections for it)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    attentions = [("self_attn", block.self_attn)]
    if block.cross_attn is not None:
        attentions.append(("cross_attn", block.cross_attn))
    for prefix, attn in attentions:
        q, kv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        if attn.cross:
            _interleave_rows(attn.kv_proj, [kv, kv], tp)
            plan[f"{prefix}.q_proj"] = ColwiseParallel()
            plan[f"{prefix}.kv_proj"] = ColwiseParallel()
        else:
            _interleave_rows(attn.qkv_proj, [q, kv, kv], tp)
            plan[f"{prefix}.qkv_proj"] = ColwiseParallel()
        plan[f"{prefix}.out_proj"] = RowwiseParallel()
    if block.ffn.gated:
        d_ff = block.ffn.fc_out.in_features
        _interleave_rows(block.ffn.fc_in, [d_ff, d_ff], tp)
    plan["ffn.fc_in"] = ColwiseParallel()
    plan["ffn.fc_out"] = RowwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: object) -> nn.Module:
    """Split every ``TransformerBlock`` of ``model`` over the 1-D ``mesh`` (in place; returns it).

    Every rank must hold the same full weights beforehand (same seed, or the same checkpoint).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()  # type: ignore[attr-defined]
    check_tensor_parallel(model, tp)
    for block in [m for m in model.modules() if isinstance(m, TransformerBlock)]:
        parallelize_module(block, mesh, tensor_parallel_plan(block, tp))  # type: ignore[arg-type]
        for attn in (block.self_attn, block.cross_attn):
            if attn is not None:  # the local heads this rank computes
                attn.n_heads //= tp
                attn.n_kv_heads //= tp
    return model
