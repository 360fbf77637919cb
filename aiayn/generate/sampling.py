"""How the next token is chosen: argmax, or a draw with temperature / top-k / top-p and CTRL's
repetition penalty. A seeded ``TokenChooser`` reproduces its whole sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SamplingConfig:
    """How the next token is drawn. temperature 0 = greedy (argmax)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")


def apply_repetition_penalty(logits: Tensor, previous: Tensor, penalty: float) -> Tensor:
    """CTRL's penalty: logits (b, v) of the ids in ``previous`` (b, t) divided (if > 0) or multiplied
    by it, once per id."""
    if penalty == 1.0:
        return logits
    seen = torch.gather(logits, 1, previous)  # (b, t)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(1, previous, seen)


def filter_logits(logits: Tensor, *, top_k: int | None, top_p: float | None) -> Tensor:
    """Keep the top-k logits (b, v) and/or the smallest set whose probability reaches top_p; -inf elsewhere."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (b, v) each
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token if the tokens ranked above it already reach top_p (the first always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: Tensor, previous: Tensor, cfg: SamplingConfig,
                generator: torch.Generator | None = None) -> Tensor:
    """logits (b, v), previous (b, t) -> next ids (b,) in float32: the penalty, then (temperature > 0)
    temperature, top-k / top-p and one draw per row."""
    logits = apply_repetition_penalty(logits.float(), previous, cfg.repetition_penalty)
    if cfg.temperature == 0:
        return logits.argmax(-1)
    logits = filter_logits(logits / cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class TokenChooser:
    """Each row's next token: the argmax without a ``SamplingConfig``, else a seeded ``sample_next``."""

    def __init__(self, sampling: SamplingConfig | None, device: torch.device) -> None:
        self.sampling = sampling
        self.generator = (torch.Generator(device=device).manual_seed(sampling.seed)
                          if sampling is not None and sampling.seed is not None else None)

    @property
    def needs_history(self) -> bool:
        """Whether ``choose`` reads the ids so far (the repetition penalty does); greedy does not."""
        return self.sampling is not None

    def choose(self, logits: Tensor, history: Tensor | None) -> Tensor:
        """logits (b, v), history (b, n) ids so far (or None when not ``needs_history``) -> (b,) ids"""
        if self.sampling is None:
            return logits.argmax(-1)
        assert history is not None, "sampling needs the ids so far (repetition penalty)"
        return sample_next(logits, history, self.sampling, self.generator)
