"""Positional encodings for the page: sinusoids and their dot products, RoPE's rotations, the model's own."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aiayn.explore.models import Explorable
from aiayn.explore.probes import pack_matrix
from aiayn.nn import positional

MAX_POSITIONS = 256  # rows of the tables the page draws
STARTS = (0, 20, 50)  # the curves' start positions t, for dot products against the offset k
MAX_OFFSET = 100


def offset_curves(table: Tensor, *, cosine: bool = False) -> dict[str, Any]:
    """table (P, d) -> for each start t in STARTS, [table[t] · table[t + k] for k = 0..K]."""
    last = table.shape[0] - 1
    k_max = min(MAX_OFFSET, last - max(STARTS))
    starts = list(STARTS)
    if k_max < MAX_OFFSET // 2:  # a short table (a model with a small context)
        k_max = last // 2
        starts = sorted({0, (last - k_max) // 2, last - k_max})
    rows = table / table.norm(dim=-1, keepdim=True).clamp(min=1e-12) if cosine else table
    offsets = torch.arange(k_max + 1, device=table.device)
    curves = [{"start": t, "values": (rows[t] * rows[t + offsets]).sum(-1).tolist()} for t in starts]
    return {"offsets": offsets.tolist(), "curves": curves, "cosine": cosine}


def rope_panel(head_dim: int, base: float, n_positions: int) -> dict[str, Any]:
    """RoPE's cos(pos x theta_i), (P, d_h / 2), and q(t)·k(t + k) of one random q, k for each start t."""
    rope = positional.RotaryEmbedding(head_dim, max(n_positions, max(STARTS) + MAX_OFFSET + 1), base=base)
    positions = torch.arange(rope.max_len)[None]  # (1, P)
    cos, sin = rope(positions)  # (1, P, d_h) each
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, head_dim, generator=g).unbind(0)  # (1, 1, 1, d_h) each
    rotated_q = positional.apply_rotary(q.expand(1, 1, rope.max_len, head_dim), cos, sin)[0, 0]  # (P, d_h)
    rotated_k = positional.apply_rotary(k.expand(1, 1, rope.max_len, head_dim), cos, sin)[0, 0]
    offsets = torch.arange(MAX_OFFSET + 1)
    curves = [{"start": t, "values": (rotated_q[t] * rotated_k[t + offsets]).sum(-1).tolist()} for t in STARTS]
    theta = torch.atan2(sin[0, 1, : head_dim // 2], cos[0, 1, : head_dim // 2])  # (d_h / 2,) angle per position
    return {"head_dim": head_dim, "base": base, "theta": theta.tolist(),
            "cos": pack_matrix(cos[0, :n_positions, : head_dim // 2]),
            "dots": {"offsets": offsets.tolist(), "curves": curves, "cosine": False}}


def positions_view(ex: Explorable) -> dict[str, Any]:
    c = ex.config
    d_model = c.d_model if c.d_model % 2 == 0 else c.d_model + 1
    n = min(MAX_POSITIONS, max(c.max_seq_len, 128))
    long_table = positional.sinusoidal_encoding(torch.arange(max(n, max(STARTS) + MAX_OFFSET + 1)), d_model)
    rope_dim = c.head_dim if c.head_dim % 2 == 0 else 64
    return {
        "sinusoidal": {"d_model": d_model, "table": pack_matrix(long_table[:n]),
                       "dots": offset_curves(long_table)},
        "rope": rope_panel(rope_dim, 10000.0, n),  # the RoPE paper's base; the model's own below
        "model": model_positions(ex),
    }


@torch.inference_mode()
def model_positions(ex: Explorable) -> dict[str, Any]:
    c = ex.config
    name = "encoder" if hasattr(ex.model, "encoder") else "decoder"  # the first stack the model has
    stack = getattr(ex.model, name)
    n = min(MAX_POSITIONS, c.max_seq_len)
    if isinstance(stack.absolute, positional.SinusoidalPositionalEncoding):
        table = stack.absolute.pe[:n]
        return {"scheme": "sinusoidal", "title": f"the model's sinusoidal table ({c.sinusoidal_layout} layout, "
                f"d_model {c.d_model}, {name})", "table": pack_matrix(table),
                "dots": offset_curves(stack.absolute.pe)}
    if isinstance(stack.absolute, positional.LearnedPositionalEmbedding):
        table = stack.absolute.weight[stack.absolute.offset:][:n].float()  # (P, d)
        unit = table / table.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        return {"scheme": "learned", "title": f"the model's learned position table ({c.max_seq_len} x {c.d_model})",
                "table": pack_matrix(table), "similarity": pack_matrix(unit @ unit.T),
                "dots": offset_curves(table, cosine=True)}
    if isinstance(stack.rotary, positional.RotaryEmbedding):
        return {"scheme": "rope", "title": f"the model's RoPE (head_dim {c.head_dim}, base {c.rope_base:g})",
                **rope_panel(c.head_dim, c.rope_base, n)}
    if isinstance(stack.relative, positional.ALiBi | positional.T5RelativeBias):
        positions = torch.arange(min(n, 64), device=ex.device)[None]  # (1, t)
        bias = stack.relative(positions, positions)[0]  # (h, t, t)
        return {"scheme": c.positional, "title": f"the model's {c.positional} attention bias per head (query x key)",
                "bias": pack_matrix(bias)}
    return {"scheme": "none", "title": "this model adds no positions (a set model: order does not matter)"}
