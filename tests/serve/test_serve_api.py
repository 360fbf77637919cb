"""The OpenAI API of a live server (uvicorn on 127.0.0.1) over the tiny model, driven by the
official ``openai`` client (and httpx where the raw bytes matter). Answers are checked against the
model itself: greedy text equals the library's decode loop, log-probabilities its logits, embeddings
its hidden states."""

from __future__ import annotations

import base64
import concurrent.futures
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from serve_helpers import MODEL_NAME
from torch.testing import assert_close

from aiayn.generate import greedy_decoder_only
from aiayn.serve.embedding import EmbeddingJob

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, server!"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    url, _ = tiny_server
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def lm(tiny_server):
    return tiny_server[1].served.lm


def chat_ids(lm, messages=MESSAGES) -> list[int]:
    return lm.encode(lm.chat_template.render(messages))


def greedy(lm, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The library's greedy tokens and their logits (n, v) for ``ids`` alone."""
    result = greedy_decoder_only(lm.model, torch.tensor([ids]), max_new_tokens=n)
    return result.tokens[0].tolist(), result.logits[0]


def sse_lines(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line for line in response.iter_lines() if line.startswith("data:")]


def test_models_are_listed_and_an_unknown_one_is_404(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).owned_by == "aiayn"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_chat_answer_is_the_models_greedy_continuation(client, lm):
    answer = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    ids = chat_ids(lm)
    tokens, _ = greedy(lm, ids, 20)
    assert answer.choices[0].message.content == lm.decode(tokens)
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        len(ids), 20, len(ids) + 20)
    assert answer.object == "chat.completion" and answer.model == MODEL_NAME and answer.id.startswith("chatcmpl-")


def test_chat_streamed_equals_whole_with_usage_and_done(client, tiny_server):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=25,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=25,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    lines = sse_lines(tiny_server[0], {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, "stream": True})
    assert lines[-1] == "data: [DONE]" and all(json.loads(line[5:]) for line in lines[:-1])


def test_the_developer_role_is_the_templates_system_role(client, lm):
    developer = [{"role": "developer", "content": "Be brief."}, MESSAGES[1]]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=developer, max_tokens=12, temperature=0)
    assert answer.usage.prompt_tokens == len(chat_ids(lm))  # rendered as MESSAGES, whose first is "system"
    assert answer.choices[0].message.content == lm.decode(greedy(lm, chat_ids(lm), 12)[0])


def test_completions_of_several_prompts_whole_and_streamed(client, lm):
    prompts = ["The quick brown fox", "Numbers like 123"]
    whole = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0)
    for choice, text in zip(whole.choices, prompts, strict=True):
        assert choice.text == lm.decode(greedy(lm, lm.encode(text), 12)[0])
    assert whole.usage.completion_tokens == 24 and [c.index for c in whole.choices] == [0, 1]
    streamed = ["", ""]
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0,
                                           stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in whole.choices]
    tokens = client.completions.create(model=MODEL_NAME, prompt=lm.encode(prompts[0]), max_tokens=12, temperature=0)
    assert tokens.choices[0].text == whole.choices[0].text  # a prompt given as token ids


def spanning_stop(lm, tokens: list[int]) -> str:
    """A stop string that spans two tokens of ``tokens``' text: the characters around a boundary
    (whole characters, none of them a broken byte's U+FFFD)."""
    for k in range(3, len(tokens) - 1):
        before, after = lm.decode(tokens[:k]), lm.decode(tokens[: k + 1])
        piece = after[len(before) - 2: len(before) + 2]
        if len(piece) == 4 and "\ufffd" not in piece and after.startswith(before):
            return piece
    raise AssertionError("no token boundary between whole characters in the answer")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_across_tokens_ends_the_answer_before_it(client, lm, stream):
    tokens, _ = greedy(lm, chat_ids(lm), 40)
    full = lm.decode(tokens)
    stop = spanning_stop(lm, tokens)
    expected = full[: full.index(stop)]
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0, stop=["never-seen", stop])
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert text == expected and finish == "stop"


def test_logprobs_are_the_models(client, lm):
    answer = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3)
    tokens, logits = greedy(lm, chat_ids(lm), 8)
    expected = torch.log_softmax(logits, dim=-1)  # (8, v)
    content = answer.choices[0].logprobs.content
    assert [entry.token for entry in content] == [lm.decode([t]) for t in tokens]
    assert_close(torch.tensor([e.logprob for e in content]), expected[torch.arange(8), tokens])
    top = torch.tensor([[t.logprob for t in e.top_logprobs] for e in content])  # (8, 3)
    assert_close(top, expected.topk(3).values)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    legacy = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    logprobs = legacy.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0


def test_a_seed_reproduces_a_sampled_answer(client):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=30, temperature=1.0,
                                              top_p=0.95, seed=seed).choices[0].message.content
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_concurrent_requests_get_what_they_get_alone(client):
    prompts = [f"Question {i}: {'why ' * i}is the sky blue?" for i in range(6)]

    def ask(text: str) -> str:
        return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": text}],
                                              max_tokens=15 + len(text) % 7, temperature=0).choices[0].message.content

    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_embeddings_are_mean_pooled_hidden_states(client, lm, tiny_server):
    texts = ["hello world", "The quick brown fox jumps"]
    expected = EmbeddingJob(lm, [lm.encode(t) for t in texts]).run()
    default = client.embeddings.create(model=MODEL_NAME, input=texts)  # the client asks for base64
    as_float = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    for result in (default, as_float):
        assert_close(torch.tensor([d.embedding for d in result.data]), expected)
    assert default.usage.prompt_tokens == sum(len(lm.encode(t)) for t in texts)
    raw = httpx.post(f"{tiny_server[0]}/embeddings", json={"model": MODEL_NAME, "input": "hello world",
                                                          "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert_close(torch.from_numpy(vector.copy()), expected[0])


def test_health_and_metrics(client, tiny_server):
    url = tiny_server[0].removesuffix("/v1")
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'aiayn_requests_total{route="/v1/chat/completions",status="200"}' in text
    for name in ("aiayn_queue_depth", "aiayn_running_requests", "aiayn_batch_occupancy", "aiayn_kv_cache_slots 4.0",
                 "aiayn_prompt_tokens_total", "aiayn_generation_tokens_total",
                 "aiayn_time_to_first_token_seconds_count", "aiayn_inter_token_latency_seconds_bucket",
                 "aiayn_generation_tokens_per_second", "aiayn_decode_batch_size_bucket"):
        assert name in text, name
