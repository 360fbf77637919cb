"""Greedy decoding over the KV cache (beam search and sampling build on the same loop).

Each function can run with ``use_cache=False``, recomputing the whole sequence every step: the
reference the cached path is tested against.
"""

from __future__ import annotations

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
) -> GreedyResult:
    """Continue each row of ``prompt`` (b, t), left-padded where ``prompt_valid`` is False.

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
    cache = model.new_cache(b, t + max_new_tokens) if use_cache else None
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
