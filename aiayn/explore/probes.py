"""Attention as the model computes it: one forward with ``need_weights=True`` per text, kept so the page can
fetch it a layer at a time. Shapes: h heads, t_q queries, t_k keys, s source, t target tokens."""

from __future__ import annotations

import base64
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from aiayn.device import autocast
from aiayn.explore.models import Explorable, ExploreInputError

CACHE_BYTES = 512 * 2**20  # attention kept for recent texts, at most this much (oldest dropped first)


def pack_matrix(x: Tensor) -> dict[str, Any]:
    """A float tensor for the page: its shape and its float32 values, little-endian, base64."""
    array = np.ascontiguousarray(x.detach().to(torch.float32).cpu().numpy(), dtype="<f4")
    return {"shape": list(array.shape), "dtype": "float32", "data": base64.b64encode(array.tobytes()).decode()}


@dataclass
class AttentionStack:
    """One kind of attention of a model: per layer (h, t_q, t_k) weights."""

    name: str  # "self" (decoder-only / encoder-only), "encoder", "decoder", "cross", "task"
    title: str
    queries: str  # which token row labels the queries: "tokens", "source", "target"
    keys: str
    causal: bool
    layers: list[Tensor]

    def describe(self) -> dict[str, Any]:
        h, t_q, t_k = self.layers[0].shape
        return {"name": self.name, "title": self.title, "queries": self.queries, "keys": self.keys,
                "causal": self.causal, "layers": len(self.layers), "heads": h, "shape": [t_q, t_k]}


@dataclass
class AttentionProbe:
    """The attention of one input: its tokens (per side) and its stacks."""

    key: str
    tokens: dict[str, list[str]]  # side -> display labels
    ids: dict[str, list[int]]
    stacks: dict[str, AttentionStack]
    note: str = ""

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for stack in self.stacks.values() for w in stack.layers)

    def describe(self) -> dict[str, Any]:
        return {"key": self.key, "tokens": self.tokens, "ids": self.ids, "note": self.note,
                "stacks": [stack.describe() for stack in self.stacks.values()]}

    def layer(self, stack: str, layer: int) -> Tensor:
        """(h, t_q, t_k) weights of one layer; KeyError / IndexError for a bad name or index."""
        layers = self.stacks[stack].layers
        if not 0 <= layer < len(layers):
            raise IndexError(f"layer {layer} is out of range: {stack} has {len(layers)} layers (0 to {len(layers) - 1})")
        return layers[layer]


def kept(weights: Tensor) -> Tensor:
    """Attention weights as the cache keeps them: a float32 copy on the CPU."""
    return weights.float().to("cpu", copy=True)


def probe_key(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


@torch.inference_mode()
def compute_attention(ex: Explorable, text: str, target: str | None = None) -> AttentionProbe:
    """The model's attention on ``text`` (translation: the source; ``target`` default: its greedy output)."""
    key = probe_key(ex.kind, text, target or "")
    if ex.kind == "task":
        return _task_attention(ex, text, key)
    ids = ex.tokens(text, "the source" if ex.kind == "translation" else "the text")
    with autocast(ex.device):  # bfloat16 on CUDA (the softmax stays float32); nothing on the CPU
        if ex.kind == "translation":
            return _translation_attention(ex, ids, target, key)
        tokens = torch.tensor([ids], device=ex.device)  # (1, t)
        out = ex.model(tokens, need_weights=True)
    title = "causal self-attention" if ex.kind == "decoder" else "self-attention (bidirectional)"
    stack = AttentionStack("self", title, "tokens", "tokens", ex.kind == "decoder",
                           [kept(w[0]) for w in out.attentions])  # each (h, t, t)
    return AttentionProbe(key, {"tokens": [ex.label(i) for i in ids]}, {"tokens": ids}, {"self": stack})


def _translation_attention(ex: Explorable, src_ids: list[int], target: str | None, key: str) -> AttentionProbe:
    from aiayn.generate import greedy_encoder_decoder, max_target_lengths

    assert ex.bos_id is not None and ex.eos_id is not None
    src = torch.tensor([src_ids], device=ex.device)  # (1, s)
    note = ""
    if target is not None and target.strip():
        tgt_ids = ex.tokens(target, "the target", target=True)[:-1]  # without </s>: with <s>, within ex.limit
    else:  # the model's own greedy translation
        limit = max_target_lengths(torch.ones_like(src, dtype=torch.bool), max_len_a=1.2, max_len_b=10,
                                   cap=ex.limit - 1)
        result = greedy_encoder_decoder(ex.model, src, bos_id=ex.bos_id, eos_id=ex.eos_id, max_new_tokens=limit)
        tgt_ids = [i for i in result.tokens[0].tolist()[: int(result.lengths[0])] if i != ex.eos_id]
        note = f"target: the model's greedy translation, \u201c{ex.decode(tgt_ids)}\u201d"
    tgt_in = torch.tensor([[ex.bos_id, *tgt_ids]], device=ex.device)  # (1, t): <s> + target, the decoder's queries
    out = ex.model(src, tgt_in, need_weights=True)
    stacks = {
        "encoder": AttentionStack("encoder", "encoder self-attention", "source", "source", False,
                                  [kept(w[0]) for w in out.encoder_attentions]),
        "decoder": AttentionStack("decoder", "decoder self-attention (causal)", "target", "target", True,
                                  [kept(w[0]) for w in out.attentions]),
        "cross": AttentionStack("cross", "cross-attention: target queries, source keys", "target", "source",
                                False, [kept(w[0]) for w in out.cross_attentions]),
    }
    target_ids = [ex.bos_id, *tgt_ids]
    return AttentionProbe(key, {"source": [ex.source_label(i) for i in src_ids], "target": [ex.label(i) for i in target_ids]},
                          {"source": src_ids, "target": target_ids}, stacks, note)


def _task_attention(ex: Explorable, text: str, key: str) -> AttentionProbe:
    try:
        example = ex.task.attention_example(ex.model, text.strip() or None)
    except ValueError as exc:  # the task's own message quotes the input: keep it short
        message = str(exc)
        raise ExploreInputError(message if len(message) <= 240 else message[:200] + " ...") from None
    if example is None:
        raise ExploreInputError(f"task {ex.task.name} has no attention example")
    stack = AttentionStack("task", example.title, "queries", "keys", False,
                           [kept(w) for w in example.weights])
    return AttentionProbe(key, {"queries": example.query_labels, "keys": example.key_labels}, {}, {"task": stack})


class ProbeCache:
    """Recent probes by key, at most ``CACHE_BYTES`` of weights; safe across threads."""

    def __init__(self) -> None:
        self._probes: OrderedDict[str, AttentionProbe] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, probe: AttentionProbe) -> None:
        with self._lock:
            self._probes[probe.key] = probe
            self._probes.move_to_end(probe.key)
            while len(self._probes) > 1 and sum(p.nbytes for p in self._probes.values()) > CACHE_BYTES:
                self._probes.popitem(last=False)

    def get(self, key: str) -> AttentionProbe | None:
        with self._lock:
            probe = self._probes.get(key)
            if probe is not None:
                self._probes.move_to_end(key)
            return probe
