"""Tensor parallelism (Megatron-style) via ``torch.distributed.tensor``: each ``TransformerBlock`` over a 1-D
mesh of ``tp`` ranks, q/k/v and ``fc_in`` column-wise, output projections row-wise, the rest replicated. Fused
rows are first reordered so rank r's block holds its heads' q, k and v: parallelise after loading weights.
ALiBi, T5 and the KV cache are refused."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.models.blocks import TransformerBlock
from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.mlp import FeedForward


class TensorParallelError(ValueError):
    """A model that cannot be split over the asked number of ranks."""


def _interleave_rows(linear: nn.Linear, sizes: list[int], tp: int) -> None:
    """Reorder a fused projection's rows [A | B | ...] to [A_0 B_0 ... | A_1 B_1 ... | ...]."""
    parts = [rows.chunk(tp) for rows in torch.arange(sum(sizes)).split(sizes)]  # each projection's, per rank
    order = torch.cat([projection[r] for r in range(tp) for projection in parts])
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
    """One block's ``parallelize_module`` plan (reordering its fused projections)."""
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
    """Split each ``TransformerBlock`` over ``mesh`` in place (every rank holds the same weights)."""
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
