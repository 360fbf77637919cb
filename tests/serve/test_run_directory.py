"""A model trained with aiayn (the shakespeare-char fixture run) served with ``--run``: completions
equal the library's greedy decoding; no chat template and characters outside the vocabulary are 400s."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from serve_helpers import live_server

from aiayn.generate import greedy_decoder_only
from aiayn.serve import build_state, load_served_model

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "old_runs" / "shakespeare"


def test_a_character_level_run_serves_completions():
    served = load_served_model(run_dir=RUN)
    assert served.name == "shakespeare"
    state, lines = build_state(served, max_batch=2, kv_layout="slots")
    assert "KV cache: 2 slots x 64 tokens (float32)" in lines[1] and "no chat template" in lines[0]
    lm = served.lm
    with live_server(state) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        answer = client.completions.create(model="shakespeare", prompt="ROMEO:\n", max_tokens=20, temperature=0)
        expected = greedy_decoder_only(lm.model, torch.tensor([lm.encode("ROMEO:\n")]), max_new_tokens=20)
        assert answer.choices[0].text == lm.decode(expected.tokens[0].tolist())
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="shakespeare", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
            client.completions.create(model="shakespeare", prompt="caf\u00e9", max_tokens=2)
