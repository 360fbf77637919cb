"""Positional schemes: sinusoidal (paper section 3.5) and learned absolute embeddings, RoPE
(``RotaryEmbedding`` + ``apply_rotary``), and score biases (``ALiBi``, ``T5RelativeBias``).
All take explicit position ids, so padded and cached sequences get the positions of unpadded ones."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from aiayn.config import SINUSOIDAL_LAYOUTS
from aiayn.nn import data_checks


def sinusoidal_encoding(positions: Tensor, d_model: int, *, layout: str = "interleaved") -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); positions (...) ->
    (..., d_model) float32, computed in float64. ``layout="split"``: sines, then cosines (Marian, fairseq)."""
    if d_model % 2 != 0:
        raise ValueError(f"sinusoidal_encoding needs an even d_model, got {d_model}")
    if layout not in SINUSOIDAL_LAYOUTS:
        raise ValueError(f"unknown sinusoidal layout {layout!r}; choose one of {', '.join(SINUSOIDAL_LAYOUTS)}")
    i = torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device)  # 2i
    inv_freq = 1.0 / torch.pow(10000.0, i / d_model)  # 1 / 10000^(2i/d), (d/2,)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., d/2)
    if layout == "split":
        return torch.cat((torch.sin(angles), torch.cos(angles)), dim=-1).to(torch.float32)
    pe = torch.empty(*angles.shape[:-1], d_model, dtype=torch.float64, device=positions.device)
    pe[..., 0::2] = torch.sin(angles)
    pe[..., 1::2] = torch.cos(angles)
    return pe.to(torch.float32)


def _check_positions(positions: Tensor, max_len: int, what: str) -> None:
    # Read only eager on the CPU (no graph break, no device wait); elsewhere the stack checks.
    if not data_checks.reads_data(positions):
        return
    if positions.numel() and int(positions.max()) >= max_len:
        raise ValueError(f"{what}: position {int(positions.max())} is beyond the model's maximum "
                         f"(max_seq_len={max_len}); shorten the input or build the model with a larger max_seq_len")


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoids, precomputed for ``max_len`` positions (a buffer, not a parameter)."""

    def __init__(self, d_model: int, max_len: int, *, layout: str = "interleaved") -> None:
        super().__init__()
        self.max_len = max_len
        pe = sinusoidal_encoding(torch.arange(max_len), d_model, layout=layout)  # (max_len, d)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        """positions (b, t) -> (b, t, d)"""
        _check_positions(positions, self.max_len, "SinusoidalPositionalEncoding")
        return self.pe[positions]


class LearnedPositionalEmbedding(nn.Embedding):
    """A trained vector per position (BERT, GPT-2); position p reads row p + ``offset`` (BART's 2)."""

    def __init__(self, max_len: int, d_model: int, *, offset: int = 0) -> None:
        super().__init__(max_len + offset, d_model)
        self.max_len, self.offset = max_len, offset

    def forward(self, positions: Tensor) -> Tensor:
        """positions (b, t) -> (b, t, d)"""
        _check_positions(positions, self.max_len, "LearnedPositionalEmbedding")
        return super().forward(positions + self.offset if self.offset else positions)


def rotate_half(x: Tensor) -> Tensor:
    """(..., d) -> (..., d): [x1, x2] -> [-x2, x1] with x1, x2 the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i + d/2}) (Hugging Face LLaMA's) by pos * theta_i; x (b, h, t, d_h), cos, sin
    (b or 1, t, d_h)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # (b, 1, t, d_h)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE for positions [0, max_len)."""

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"RotaryEmbedding needs an even head_dim, got {head_dim}")
        self.max_len = max_len
        # 1 / base^(2i/d_h), (d_h/2,); written as Hugging Face LLaMA does, so the float32 tables match
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq  # (max_len, d_h/2)
        angles = torch.cat((angles, angles), dim=-1)  # (max_len, d_h), halves share frequencies
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (b, t) -> (cos, sin), each (b, t, d_h)"""
        _check_positions(positions, self.max_len, "RotaryEmbedding")
        return self.cos[positions], self.sin[positions]


class ALiBi(nn.Module):
    """Attention with linear biases: score(i, j) -= m_h * |i - j|, slopes 2^(-8/h), 2^(-16/h), ..."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", self.make_slopes(n_heads), persistent=False)

    @staticmethod
    def make_slopes(n_heads: int) -> Tensor:
        def power_of_two_slopes(n: int) -> list[float]:
            start = 2 ** (-8 / n)
            return [start ** (i + 1) for i in range(n)]

        if math.log2(n_heads).is_integer():
            slopes = power_of_two_slopes(n_heads)
        else:
            closest = 2 ** math.floor(math.log2(n_heads))
            slopes = power_of_two_slopes(closest)
            slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
        return torch.tensor(slopes, dtype=torch.float32)

    def forward(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """q_positions (b, t_q), k_positions (b, t_k) -> bias (b, h, t_q, t_k)"""
        distance = (q_positions[:, :, None] - k_positions[:, None, :]).abs()  # (b, t_q, t_k)
        return -self.slopes[None, :, None, None] * distance[:, None].float()


class T5RelativeBias(nn.Module):
    """T5's learned bias per (head, bucket of relative position j - i): exact small distances, then
    logarithmic up to ``max_distance``; bidirectional attention splits buckets by sign."""

    def __init__(self, n_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True) -> None:
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.embedding = nn.Embedding(num_buckets, n_heads)

    @staticmethod
    def bucket(relative: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
        """relative = key_pos - query_pos (any shape, long) -> bucket ids (same shape)."""
        buckets = torch.zeros_like(relative)
        if bidirectional:
            num_buckets //= 2
            buckets = buckets + (relative > 0).long() * num_buckets
            distance = relative.abs()
        else:
            distance = -torch.clamp(relative, max=0)  # only the past counts
        max_exact = num_buckets // 2
        is_small = distance < max_exact
        # Log-spaced buckets for larger distances; clamp(min=1) keeps log() finite where unused.
        large = max_exact + (
            torch.log(distance.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
        large = torch.clamp(large, max=num_buckets - 1)
        return buckets + torch.where(is_small, distance, large)

    def forward(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """q_positions (b, t_q), k_positions (b, t_k) -> bias (b, h, t_q, t_k)"""
        relative = k_positions[:, None, :] - q_positions[:, :, None]  # (b, t_q, t_k)
        buckets = self.bucket(relative, bidirectional=self.bidirectional,
                              num_buckets=self.num_buckets, max_distance=self.max_distance)
        return self.embedding(buckets).permute(0, 3, 1, 2)  # (b, h, t_q, t_k)
