"""Encoder-decoder generation: one decode loop, ``stream_encoder_decoder`` (the source encoded once,
the first step bos, filling the cache's cross-attention k/v), the functions that collect it and the
per-source length limits. Each also takes an ``Ensemble``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypedDict, Unpack

import torch
from torch import Tensor

from aiayn.cpu_share import share_cores
from aiayn.generate import results
from aiayn.generate.decoder_only import cache_slots
from aiayn.generate.ensemble import Ensemble
from aiayn.generate.results import DecodeStep, DoneCheck, GreedyResult, fill_finished, fill_id_for
from aiayn.generate.sampling import SamplingConfig, TokenChooser
from aiayn.generate.step import decode_step
from aiayn.models.encoder_decoder import EncoderDecoder


class DecodeOptions(TypedDict, total=False):
    """The options of ``stream_encoder_decoder`` that the functions collecting it pass on."""

    src_valid: Tensor | None
    eos_id: int | None
    compile: bool


def stream_encoder_decoder(
    model: EncoderDecoder | Ensemble,
    src: Tensor,
    *,
    bos_id: int,
    max_new_tokens: int | Tensor,
    sampling: SamplingConfig | None = None,
    src_valid: Tensor | None = None,
    eos_id: int | None = None,
    fill_id: int | None = None,
    use_cache: bool = True,
    compile: bool = False,
) -> Iterator[DecodeStep]:
    """Decode a target for each row of ``src`` (b, s) from ``bos_id``, one ``DecodeStep`` per new token,
    lazily. max_new_tokens: one limit or (b,) (``max_target_lengths``), eos included. A row that emits
    ``eos_id`` or reaches its limit holds ``fill_id``. The rest as ``stream_decoder_only``'s."""
    if compile and not use_cache:
        raise ValueError("compile=True decodes through the KV cache; it needs use_cache=True")
    limit = torch.as_tensor(max_new_tokens, device=src.device).expand(src.shape[0])  # (b,)
    return _decode(model, src, src_valid, bos_id=bos_id, limit=limit, chooser=TokenChooser(sampling, src.device),
                   eos_id=eos_id, fill_id=fill_id_for(model.config.pad_id, eos_id, fill_id), use_cache=use_cache,
                   compile=compile)


@torch.inference_mode()
def _decode(model: EncoderDecoder | Ensemble, src: Tensor, src_valid: Tensor | None, *, bos_id: int, limit: Tensor,
            chooser: TokenChooser, eos_id: int | None, fill_id: int | None, use_cache: bool,
            compile: bool) -> Iterator[DecodeStep]:
    """``stream_encoder_decoder``'s loop: limit (b,) most new tokens per row."""
    b, device = src.shape[0], src.device
    n_steps = int(limit.max())
    encoded = model.encode(src, src_valid=src_valid)  # once per source: memory (b, s, d)
    # bos + at most n_steps - 1 fed tokens (compiled: rounded up, so lengths share a graph)
    cache = model.new_cache(b, cache_slots(n_steps, compile)) if use_cache else None
    # bos and the tokens so far (b, 1 + i): what the recomputing path reads, and the penalty's history.
    target = torch.full((b, 1), bos_id, dtype=torch.long, device=device)
    done = limit <= 0  # (b,) a row with no token to generate is done from the start
    check = DoneCheck(device)  # "every row done?": read a step late on a GPU (the host runs ahead)
    for i in range(n_steps):
        share_cores()  # this job's fair share of the cores beside other aiayn jobs (aiayn/cpu_share.py)
        if cache is None:  # generated tokens are real even if one equals pad_id
            logits = model.decode(target, encoded, tgt_valid=torch.ones_like(target, dtype=torch.bool)).logits[:, -1]
        else:  # bos first, which fills the cross-attention keys and values of the cache
            logits = decode_step(model, target[:, -1:], cache, memory=encoded.memory if i == 0 else None,
                                 memory_valid=encoded.valid, compile=compile and i > 0)  # (b, v)
        token = fill_finished(chooser.choose(logits, target), done, fill_id)  # (b,)
        active = ~done
        if eos_id is not None:
            done = done | (token == eos_id)
        done = done | (i + 1 >= limit)
        target = torch.cat([target, token[:, None]], dim=1)
        if check.stopped_before():
            return  # (lagged) the step before ended every row: this one is dropped
        yield DecodeStep(index=i, tokens=token, logits=logits, active=active, done=done, cache=cache)
        if check.after(done):
            return


@torch.inference_mode()
def greedy_encoder_decoder(model: EncoderDecoder | Ensemble, src: Tensor, *, bos_id: int,
                           max_new_tokens: int | Tensor, use_cache: bool = True,
                           **options: Unpack[DecodeOptions]) -> GreedyResult:
    """Translate each row of ``src`` (b, s) greedily; the options are ``stream_encoder_decoder``'s."""
    results.known_options("greedy_encoder_decoder", options, DecodeOptions)
    return GreedyResult.from_steps(stream_encoder_decoder(
        model, src, bos_id=bos_id, max_new_tokens=max_new_tokens, use_cache=use_cache, **options),
        with_lengths=True)


@torch.inference_mode()
def sample_encoder_decoder(model: EncoderDecoder | Ensemble, src: Tensor, *, bos_id: int,
                           max_new_tokens: int | Tensor, sampling: SamplingConfig | None = None,
                           **options: Unpack[DecodeOptions]) -> Tensor:
    """Sample a target for each row of ``src`` (b, s) -> ids (b, n); options as ``stream_encoder_decoder``."""
    results.known_options("sample_encoder_decoder", options, DecodeOptions)
    steps = stream_encoder_decoder(model, src, bos_id=bos_id, max_new_tokens=max_new_tokens,
                                   sampling=sampling or SamplingConfig(), **options)
    return torch.stack([step.tokens for step in steps], dim=1)


def max_target_lengths(src_valid: Tensor, *, max_len_a: float, max_len_b: int,
                       cap: int | None = None) -> Tensor:
    """(b,) most target tokens per source, eos included (fairseq's): floor(max_len_a * real source tokens
    + max_len_b), in [1, ``cap``]."""
    src_len = src_valid.sum(dim=1).double()  # (b,) padding does not count
    limit = torch.floor(max_len_a * src_len + max_len_b).long().clamp(min=1)
    return limit if cap is None else limit.clamp(max=cap)
