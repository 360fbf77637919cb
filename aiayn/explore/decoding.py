"""Decoding step by step, for the page: each step's token, its top-k probabilities and the KV cache as it
fills (bytes measured, by ``kv_cache_bytes``'s formula, and as int8 / int4 caches would hold them)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from aiayn.device import autocast
from aiayn.explore.models import Explorable, ExploreInputError
from aiayn.generate import (
    SamplingConfig,
    max_target_lengths,
    stream_decoder_only,
    stream_encoder_decoder,
)
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.kv_memory import dtype_bytes, kv_cache_bytes

MAX_STEPS = 64
MAX_TOP_K = 20


def _cache_figures(cache: KVCache, sizes: dict[str, int]) -> dict[str, int]:
    """Bytes of the filled part of ``cache`` (measured on its tensors and by the formula)."""
    n = cache.length
    measured = sum(layer.k[:, :, :n].nbytes + layer.v[:, :, :n].nbytes for layer in cache.layers)
    dtype = cache.layers[0].k.dtype
    return {"filled": n, "measured": measured,
            "formula": kv_cache_bytes(**sizes, seq_len=n, batch_size=1, dtype=dtype),
            "int8": kv_cache_bytes(**sizes, seq_len=n, batch_size=1, dtype="int8"),
            "int4": kv_cache_bytes(**sizes, seq_len=n, batch_size=1, dtype="int4")
            if sizes["head_dim"] % 2 == 0 else None}


def _slot_norms(cache: KVCache) -> list[list[float]]:
    """(layers, filled) each slot's key length, averaged over kv heads: the page's colours."""
    n = cache.length
    return [layer.k[0, :, :n].float().norm(dim=-1).mean(dim=0).tolist() for layer in cache.layers]


@torch.inference_mode()
def decode_steps(ex: Explorable, text: str, *, steps: int = 16, top_k: int = 5, temperature: float = 0.0,
                 seed: int = 0, chat: bool = False) -> dict[str, Any]:
    """Decode up to ``steps`` tokens after ``text``, greedy (``temperature`` 0) or sampled with ``seed``."""
    if (why := ex.unavailable("generate")) is not None:
        raise ExploreInputError(why)
    sampling = SamplingConfig(temperature=temperature, seed=seed) if temperature > 0 else None
    c = ex.config
    if ex.kind == "decoder":
        prompt_text = ex.chat(text) if chat and ex.chat is not None else text
        ids, room = ex.prompt(prompt_text)
        loop = stream_decoder_only(ex.model, torch.tensor([ids], device=ex.device), max_new_tokens=min(steps, room),
                                   sampling=sampling, eos_id=ex.eos_id)
        layers = c.n_layers
    else:
        assert ex.bos_id is not None
        ids = ex.tokens(text, "the source")
        src = torch.tensor([ids], device=ex.device)  # (1, s)
        limit = max_target_lengths(torch.ones_like(src, dtype=torch.bool), max_len_a=1.2, max_len_b=10,
                                   cap=min(steps, ex.context - 1))
        loop = stream_encoder_decoder(ex.model, src, bos_id=ex.bos_id, max_new_tokens=limit,
                                      sampling=sampling, eos_id=ex.eos_id)
        layers = c.n_decoder_layers
    sizes = {"n_layers": layers, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim}
    out_steps: list[dict[str, Any]] = []
    generated: list[int] = []
    cache: KVCache | None = None
    with ex.lock, autocast(ex.device):  # the loop's forwards run in here, one per step taken
        start = time.perf_counter()
        for step in loop:
            token, logits = int(step.tokens[0]), step.logits[0]
            out_steps.append(_step(ex, step.index, token, logits, top_k, time.perf_counter() - start))
            cache = step.cache
            assert cache is not None
            out_steps[-1]["cache"] = _cache_figures(cache, sizes)
            start = time.perf_counter()
            if token == ex.eos_id:
                break
            generated.append(token)
        assert cache is not None
        norms = _slot_norms(cache)
        cross = _cross_figures(cache, sizes) if ex.kind == "translation" else None
        allocated, capacity = cache.self_nbytes, cache.max_len  # the self-attention buffers (cross: below)
        dtype = cache.layers[0].k.dtype
    side = "prompt" if ex.kind == "decoder" else "source"
    first = [ex.label(i) for i in ids] if ex.kind == "decoder" else [ex.label(ex.bos_id)]  # type: ignore[arg-type]
    return {
        "kind": ex.kind, side: {"ids": ids, "labels": [ex.source_label(i) for i in ids]},
        "fed_first": first,  # what the first step feeds: the prompt, or <s>
        "steps": out_steps, "text": ex.decode(generated), "sampling": sampling is not None,
        "cache": {"layers": layers, "kv_heads": c.n_kv_heads, "heads": c.n_heads, "head_dim": c.head_dim,
                  "dtype": str(dtype).removeprefix("torch."), "bytes_per_value": dtype_bytes(dtype),
                  "capacity": capacity, "allocated": allocated, "slot_norms": norms, "cross": cross},
    }


def _step(ex: Explorable, index: int, token: int, logits: Tensor, top_k: int, seconds: float) -> dict[str, Any]:
    probs = torch.softmax(logits.float(), dim=-1).cpu()  # (v,); read back value by value below
    top = probs.topk(min(top_k, probs.shape[0]))
    return {"index": index, "id": token, "label": ex.label(token), "p": float(probs[token]),
            "eos": token == ex.eos_id, "ms": round(seconds * 1000, 2),
            "top": [{"id": int(i), "label": ex.label(int(i)), "p": float(p)}
                    for p, i in zip(top.values, top.indices, strict=True)]}


def _cross_figures(cache: KVCache, sizes: dict[str, int]) -> dict[str, int]:
    """The cross-attention keys and values, computed once at the first step."""
    assert cache.cross is not None
    k = cache.cross[0][0]  # (1, h_kv, s, d_h)
    s = k.shape[2]
    return {"slots": s, "measured": cache.cross_nbytes,
            "formula": kv_cache_bytes(**sizes, seq_len=s, batch_size=1, dtype=k.dtype)}
