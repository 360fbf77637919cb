"""Fixtures of the server tests: the tiny model written as the Hugging Face directory ``aiayn export
--to hf`` writes (so the server loads it as users' models are loaded), a live server over it, the
tiny model in memory with one live server and its openai client for the whole session (the
sampling-options and structured-output tests share it), and one intra-op thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from serve_helpers import MODEL_NAME, live_server, tiny_state, tiny_text_model

from aiayn.serve import ServedModel, build_state
from aiayn.textgen import TextModel, export_text_model


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


@pytest.fixture(scope="session")
def tiny_lm() -> TextModel:
    """The tiny model in memory (``serve_helpers.tiny_text_model()``), shared: tests only read it."""
    return tiny_text_model()


@pytest.fixture(scope="session")
def tiny_lm_client(tiny_lm) -> Iterator[openai.OpenAI]:
    """The openai client of one live server over ``tiny_lm`` for the session: 4 slots, a context of
    256, prefill chunks of 16 (each request's answer is its own: a shared server changes none)."""
    state, _ = build_state(ServedModel(MODEL_NAME, lm=tiny_lm), max_batch=4, context=256, prefill_chunk=16)
    with live_server(state) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
