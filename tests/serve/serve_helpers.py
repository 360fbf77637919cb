"""Shared by the server tests (imported by this folder's modules and its conftest): a tiny random
decoder-only model with a real byte-level BPE tokenizer and a chat template, live uvicorn servers
on 127.0.0.1 at free ports, each in a thread of this process, and the engine stepped by hand with
its reads of device values spied on (``device_path``, ``step_until``)."""

from __future__ import annotations

import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizer_helpers import CHAT_TEMPLATE, train_tokenizer
from torch import nn

import aiayn.nn.data_checks
from aiayn.interop.gguf_text import ChatTemplate
from aiayn.models import DecoderOnly, get_preset
from aiayn.serve import build_state, load_served_model, server
from aiayn.serve.engine import Engine
from aiayn.textgen import TextModel

TEXT = (
    "The quick brown fox jumps over the lazy dog. A server answers requests as they come, and a "
    "batch of streams shares every step of the model. Tokens arrive one by one; some requests stop "
    "early, others run long. Hello world! Numbers like 12345 and 678 are split into digits. "
    "Questions? Answers. The end of a line\nand the start of another.\n"
) * 4
CONTEXT = 256
MODEL_NAME = "tiny-llama"


def tiny_text_model(seed: int = 0, context: int = CONTEXT, **sizes: int) -> TextModel:
    """A LLaMA-style model of 2 layers, GQA, with weights at a scale where attention and positions
    matter (and logits are far from ties); the end-of-text row of the output layer is zero, so the
    model never ends an answer by itself (answers run to max_tokens or a stop string). ``sizes``
    override the preset's (d_model, d_ff, ...)."""
    tok = train_tokenizer(TEXT)
    torch.manual_seed(seed)
    config = get_preset("llama-tiny", vocab_size=tok.get_vocab_size(), max_seq_len=context, **sizes)
    model = DecoderOnly(config).eval()
    g = torch.Generator().manual_seed(seed)
    eos = tok.token_to_id("<|im_end|>")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) / math.sqrt(module.in_features))
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
        model.lm_head.weight[eos] = 0.0
    template = ChatTemplate(CHAT_TEMPLATE, {"eos_token": "<|im_end|>"})
    return TextModel(model, lambda text: tok.encode(text, add_special_tokens=False).ids, lambda ids: tok.decode(ids),
                     context, eos, None, template, tok)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def live_server(state, timeout: float = 20.0) -> Iterator[str]:
    """Run uvicorn for ``state`` on 127.0.0.1 in a thread; yield its base URL ('.../v1')."""
    port = free_port()
    srv = server(state, port=port, log_level="warning")
    thread = threading.Thread(target=srv.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not srv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        srv.should_exit = True
        thread.join(timeout)


def tiny_state(tiny_dir: Path, **settings):
    served = load_served_model(tiny_dir, name=MODEL_NAME)
    settings = {"max_batch": 4, "context": CONTEXT, "prefill_chunk": 16, **settings}
    return build_state(served, **settings)[0]



# Every way a tensor's value gets into Python (on a GPU each waits for the device).
READS = ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def device_path() -> Iterator[list[str]]:
    """Take the non-CPU code path on the CPU (``aiayn.nn.data_checks.reads_data`` says False, as for
    a CUDA tensor) and list, as "function (file:line, method)", every place that reads a tensor's
    value into Python meanwhile (tests/serve/test_no_device_reads.py explains why)."""
    reads: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    saved_reads_data = aiayn.nn.data_checks.reads_data

    def spy(name: str):
        original = saved[name]

        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            reads.append(f"{caller.f_code.co_name} ({caller.f_code.co_filename}:{caller.f_lineno}, {name})")
            return original(self, *args, **kwargs)

        return read

    try:
        aiayn.nn.data_checks.reads_data = lambda t: False
        for name in READS:
            setattr(torch.Tensor, name, spy(name))
        yield reads
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        aiayn.nn.data_checks.reads_data = saved_reads_data


def step_until(engine: Engine, done: Callable[[], bool], *, spy: bool = False, limit: int = 300,
               before_step: Callable[[int], None] | None = None) -> list[str]:
    """Step ``engine`` until ``done()``: before each step ``before_step(i)`` (e.g. requests arriving
    at step i) runs, then ``done()`` is asked. With ``spy`` every step runs in ``device_path`` and
    the reads of device values seen are returned (else ``[]``). Fails after ``limit`` steps."""
    reads: list[str] = []
    for i in range(limit):
        if before_step is not None:
            before_step(i)
        if done():
            return reads
        if spy:
            with device_path() as seen:
                engine.step()
            reads += seen
        else:
            engine.step()
    raise AssertionError(f"the engine did not finish in {limit} steps")
