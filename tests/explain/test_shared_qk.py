"""`aiayn explain shared-qk`, reduced: W_Q = W_K makes the scores exactly symmetric and the
attention self-dominated; the parametrization really ties the key rows to the query rows."""

from __future__ import annotations

import torch

from aiayn.explain import run_topic
from aiayn.explain.shared_qk import share_query_key
from aiayn.models import build_model, get_preset
from aiayn.nn.attention import MultiHeadAttention


def test_shared_projection_is_symmetric_and_self_dominated(tmp_path):
    separate, shared = run_topic("shared-qk", tmp_path, quick=True).claims["results"]
    assert shared["after"]["asymmetry"] < 1e-6 < 0.1 < separate["after"]["asymmetry"]
    assert shared["before"]["self_argmax"] > 0.5 > 0.2 > separate["before"]["self_argmax"]
    assert separate["after"]["mirror_argmax"] > shared["after"]["mirror_argmax"]  # it finds the answer
    assert separate["params"] - shared["params"] == 32 * 32 + 32  # the key rows of W and b, unused


def test_share_query_key_ties_the_rows():
    torch.manual_seed(0)
    model = build_model(get_preset("gpt-tiny"))
    unused = share_query_key(model)
    attn = next(m for m in model.modules() if isinstance(m, MultiHeadAttention))
    weight, q = attn.qkv_proj.weight, attn.n_heads * attn.head_dim
    assert torch.equal(weight[:q], weight[q : 2 * q])
    assert unused == 2 * (48 * 48 + 48)  # two layers
    model(torch.randint(0, 99, (1, 5))).logits.sum().backward()
    raw = attn.qkv_proj.parametrizations.weight.original
    assert raw.grad[:q].abs().sum() > 0 and torch.equal(raw.grad[q : 2 * q], torch.zeros_like(raw.grad[q : 2 * q]))
