"""Decoding over the KV cache: greedy, and sampling with temperature / top-k / top-p.

Each greedy function can run with ``use_cache=False``, recomputing the whole sequence every step:
the reference the cached path is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.models.decoder_only import DecoderOnly
from aiayn.models.encoder_decoder import EncoderDecoder


@dataclass
class GreedyResult:
    tokens: Tensor  # (b, n_new) generated ids (after eos: pad_id, or eos repeated if no pad_id)
    logits: Tensor  # (b, n_new, v) the logits each token was chosen from


def _finish(next_token: Tensor, done: Tensor, eos_id: int | None, fill_id: int | None) -> tuple[Tensor, Tensor]:
    if eos_id is None:
        return next_token, done
    if fill_id is not None:
        next_token = torch.where(done, torch.full_like(next_token, fill_id), next_token)
    return next_token, done | (next_token == eos_id)


@torch.inference_mode()
def greedy_decoder_only(
    model: DecoderOnly,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    prompt_valid: Tensor | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    kv_cache: str | None = None,
) -> GreedyResult:
    """Continue each row of ``prompt`` (b, t), left-padded where ``prompt_valid`` is False.

    ``kv_cache="int8"``/``"int4"`` decodes over a quantised KV cache (float by default).

    Without ``prompt_valid`` the model's default applies: ``prompt != pad_id`` when the config has
    a pad_id, else every prompt token is real. Generated tokens always count as real.
    """
    b, t = prompt.shape
    if prompt_valid is not None:
        valid = prompt_valid
    elif model.config.pad_id is not None:  # the model's own default: pad ids are padding
        valid = prompt != model.config.pad_id
    else:
        valid = torch.ones_like(prompt, dtype=torch.bool)
    cache = model.new_cache(b, t + max_new_tokens, quantize=kv_cache) if use_cache else None
    tokens, step_valid = prompt, valid
    all_tokens, all_valid = prompt, valid
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    out_tokens, out_logits = [], []
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = model(tokens, valid=step_valid, cache=cache).logits[:, -1]
        else:
            logits = model(all_tokens, valid=all_valid).logits[:, -1]
        next_token, done_now = _finish(logits.argmax(-1), done, eos_id, model.config.pad_id)
        out_tokens.append(next_token)
        out_logits.append(logits)
        tokens, step_valid = next_token[:, None], torch.ones(b, 1, dtype=torch.bool, device=prompt.device)
        all_tokens = torch.cat([all_tokens, tokens], dim=1)
        all_valid = torch.cat([all_valid, step_valid], dim=1)
        done = done_now
        if bool(done.all()):
            break
    return GreedyResult(torch.stack(out_tokens, 1), torch.stack(out_logits, 1))


@torch.inference_mode()
def greedy_encoder_decoder(
    model: EncoderDecoder,
    src: Tensor,
    *,
    bos_id: int,
    max_new_tokens: int,
    src_valid: Tensor | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> GreedyResult:
    """Translate each row of ``src`` (b, s) greedily, starting every target with ``bos_id``."""
    b = src.shape[0]
    encoded = model.encode(src, src_valid=src_valid)  # computed once per source
    cache = model.new_cache(b, max_new_tokens + 1) if use_cache else None
    tgt = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)
    step = tgt
    done = torch.zeros(b, dtype=torch.bool, device=src.device)
    out_tokens, out_logits = [], []
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = model.decode(step, encoded, tgt_valid=torch.ones_like(step, dtype=torch.bool),
                                  cache=cache).logits[:, -1]
        else:  # generated tokens are real even if one equals pad_id
            logits = model.decode(tgt, encoded, tgt_valid=torch.ones_like(tgt, dtype=torch.bool)).logits[:, -1]
        next_token, done_now = _finish(logits.argmax(-1), done, eos_id, model.config.pad_id)
        out_tokens.append(next_token)
        out_logits.append(logits)
        step = next_token[:, None]
        tgt = torch.cat([tgt, step], dim=1)
        done = done_now
        if bool(done.all()):
            break
    return GreedyResult(torch.stack(out_tokens, 1), torch.stack(out_logits, 1))


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
    """CTRL's penalty: logits of tokens already present are divided (if > 0) or multiplied by it.

    logits (b, v), previous (b, t) token ids -> (b, v)
    """
    if penalty == 1.0:
        return logits
    seen = torch.gather(logits, 1, previous)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(1, previous, seen)


def filter_logits(logits: Tensor, *, top_k: int | None, top_p: float | None) -> Tensor:
    """Keep the top-k logits and/or the smallest set whose probability reaches top_p; -inf elsewhere."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token if the tokens ranked above it already reach top_p (the first always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: Tensor, previous: Tensor, cfg: SamplingConfig,
                generator: torch.Generator | None = None) -> Tensor:
    """logits (b, v) of the next token, previous (b, t) ids -> next ids (b,)"""
    logits = apply_repetition_penalty(logits.float(), previous, cfg.repetition_penalty)
    if cfg.temperature == 0:
        return logits.argmax(-1)
    logits = filter_logits(logits / cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate_decoder_only(
    model: DecoderOnly,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    eos_id: int | None = None,
    on_token: Callable[[Tensor], bool | None] | None = None,
    kv_cache: str | None = None,
) -> Tensor:
    """Sample a continuation of ``prompt`` (b, t) through the KV cache -> new ids (b, n <= max_new_tokens).

    ``on_token`` receives each step's (b,) ids as they are produced (for streaming); returning True
    stops early (e.g. a stop string was produced). ``kv_cache="int8"``/``"int4"``: a quantised cache.
    """
    cfg = sampling or SamplingConfig()
    generator = torch.Generator(device=prompt.device).manual_seed(cfg.seed) if cfg.seed is not None else None
    b, t = prompt.shape
    max_len = model.config.max_seq_len
    if t + max_new_tokens > max_len:
        raise ValueError(f"prompt of {t} tokens + {max_new_tokens} new tokens exceeds the model's context "
                         f"of {max_len}; shorten the prompt or ask for fewer tokens")
    cache = model.new_cache(b, t + max_new_tokens, quantize=kv_cache)
    history = prompt
    logits = model(prompt, cache=cache).logits[:, -1]
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    generated = []
    for i in range(max_new_tokens):
        next_token = sample_next(logits, history, cfg, generator)
        if eos_id is not None:
            next_token = torch.where(done, torch.full_like(next_token, eos_id), next_token)
            done = done | (next_token == eos_id)
        generated.append(next_token)
        history = torch.cat([history, next_token[:, None]], dim=1)
        if on_token is not None and on_token(next_token):
            break
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        logits = model(next_token[:, None], cache=cache).logits[:, -1]
    return torch.stack(generated, dim=1)
