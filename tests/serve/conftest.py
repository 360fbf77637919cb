"""Fixtures of the server tests: the tiny model written as the Hugging Face directory ``aiayn export
--to hf`` writes (so the server loads it as users' models are loaded), a live server over it, and
one intra-op thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serve_helpers import MODEL_NAME, live_server, tiny_state, tiny_text_model

from aiayn.textgen import export_text_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny model as a Hugging Face directory (config, safetensors, tokenizer files)."""
    return export_text_model(tiny_text_model(), tmp_path_factory.mktemp("models") / MODEL_NAME)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is fastest and steady on a busy machine (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    """(base URL, server state) of a server over the tiny model: 4 slots, prefill chunks of 16."""
    state = tiny_state(tiny_dir)
    with live_server(state) as url:
        yield url, state
