"""The beam-search tree of one source (or prompt): every candidate of every step, where it went, and the
n-best, from the search's own trace (``BeamStep``)."""

from __future__ import annotations

from typing import Any

import torch

from aiayn.device import autocast, to_device
from aiayn.explore.models import Explorable, ExploreInputError
from aiayn.generate import (
    BeamStep,
    beam_search_decoder_only,
    beam_search_encoder_decoder,
    gnmt_length_penalty,
)

MAX_BEAM = 8


@torch.inference_mode()
def beam_tree(ex: Explorable, text: str, *, beam: int = 4, length_penalty: float = 0.6,
              steps: int = 16) -> dict[str, Any]:
    """Nodes (one per candidate) and the n-best of searching ``text``'s translation or continuation."""
    if (why := ex.unavailable("beam")) is not None:
        raise ExploreInputError(why)
    trace: list[BeamStep] = []
    if ex.kind == "translation":
        assert ex.bos_id is not None and ex.eos_id is not None
        ids = ex.tokens(text, "the source")
        root = ex.label(ex.bos_id)
        with ex.lock, autocast(ex.device):
            result = beam_search_encoder_decoder(
                ex.model, torch.tensor([ids], device=ex.device), bos_id=ex.bos_id, eos_id=ex.eos_id, beam_size=beam,
                length_penalty=length_penalty, max_len_a=1.2, max_len_b=10, n_best=beam, trace=trace.append)
    else:
        ids, room = ex.prompt(text)
        root = ex.label(ids[-1])
        with ex.lock, autocast(ex.device):
            result = beam_search_decoder_only(
                ex.model, torch.tensor([ids], device=ex.device), eos_id=ex.eos_id, max_new_tokens=min(steps, room), beam_size=beam,
                length_penalty=length_penalty, n_best=beam, trace=trace.append)

    trace = [to_device(step, torch.device("cpu")) for step in trace]  # read value by value below
    nodes: list[dict[str, Any]] = [{"id": 0, "t": 0, "parent": None, "label": root, "score": 0.0,
                                    "status": "kept", "slot": 0}]
    slots = {0: 0}  # beam slot -> node id of the open beams after the previous step
    paths: dict[int, list[int]] = {0: []}  # node id -> its token ids (bos excluded)
    for step in trace:
        row = 0  # one source
        next_slots: dict[int, int] = {}
        for c in range(step.token.shape[1]):
            score = float(step.score[row, c])
            if score == float("-inf"):
                continue
            parent = slots[int(step.parent[row, c])]
            token, slot = int(step.token[row, c]), int(step.slot[row, c])
            finished = bool(step.finished[row, c])
            status = "finished" if finished else "kept" if slot >= 0 else "pruned"
            if status == "kept" and bool(step.at_limit[row]):
                status = "limit"  # open at the length limit: finished without </s>
            node = {"id": len(nodes), "t": step.t, "parent": parent, "label": ex.label(token), "score": score,
                    "status": status, "slot": slot}
            if status in ("finished", "limit"):
                node["normalized"] = score / float(gnmt_length_penalty(torch.tensor(step.t), length_penalty))
            nodes.append(node)
            paths[node["id"]] = [*paths[parent], token]
            if slot >= 0:
                next_slots[slot] = node["id"]
        slots = next_slots

    ends = {tuple(paths[n["id"]]): n["id"] for n in nodes if n["status"] in ("finished", "limit")}
    nbest = [{"tokens": [ex.label(i) for i in h.tokens.tolist()], "text": ex.decode([i for i in h.tokens.tolist()
                                                                                    if i != ex.eos_id]),
              "score": h.score, "normalized": h.normalized_score, "length": int(h.tokens.shape[0]),
              "node": ends.get(tuple(h.tokens.tolist()))}
             for h in result.nbest[0]]
    return {"kind": ex.kind, "source": [ex.source_label(i) for i in ids], "beam": beam, "length_penalty": length_penalty,
            "steps": len(trace), "nodes": nodes, "nbest": nbest}
