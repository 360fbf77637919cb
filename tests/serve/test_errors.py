"""What the server says to requests it cannot serve: a 4xx in OpenAI's error format with one line
naming the field and what to do, never a 500 or a traceback; 401 without the API key; 429 with
Retry-After past the queue limit; and a client that leaves frees its slot within a step."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from serve_helpers import CONTEXT, MODEL_NAME, live_server, tiny_state

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


def with_(**fields):
    return {**CHAT, **fields}


BAD_CHAT = [
    (with_(messages=[]), "messages", "at least 1 item"),
    ({"model": MODEL_NAME}, "messages", "is required"),
    (with_(temperature="0.5"), "temperature", "valid number (got '0.5')"),
    (with_(temperature=-1), "temperature", "greater than or equal to 0"),
    (with_(temperature=float("nan")), "temperature", "finite number"),
    (with_(top_p=float("inf")), "top_p", "finite number"),
    (with_(top_p=0), "top_p", "greater than 0"),
    (with_(max_tokens=-3), "max_tokens", "greater than or equal to 1"),
    (with_(max_tokens=2.5), "max_tokens", "valid integer"),
    (with_(max_tokens=CONTEXT), "messages", "context is 256 tokens"),
    (with_(seed=-1), "seed", "greater than or equal to 0"),
    (with_(seed=2**64), "seed", "less than"),
    (with_(stream="yes"), "stream", "valid boolean"),
    (with_(stop=5), "stop", "string or a list of strings"),
    (with_(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (with_(stop=[""]), "stop", "none of them empty"),
    (with_(n=129), "n", "less than or equal to 128"),
    (with_(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
    (with_(top_logprobs=2), "top_logprobs", "needs logprobs=true"),
    (with_(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (with_(tools=[{"type": "function"}]), "tools.0.function", "is required"),
    (with_(tool_choice="auto"), "tool_choice", "only allowed when tools are given"),
    (with_(stream_options={"include_usage": True}), "stream_options", "only allowed with stream=true"),
    (with_(max_tokens=3, max_completion_tokens=4), "max_tokens", "differ"),
    (with_(messages=[{"role": "robot", "content": "hi"}]), "messages.0.role", "'user'"),
    (with_(messages=[{"role": "user"}]), "messages.0", "content: is required in a message of role user"),
    (with_(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content", "only text content parts"),
    (with_(messages="hello"), "messages", "valid list"),
]


@pytest.mark.parametrize(("body", "param", "needle"), BAD_CHAT, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_CHAT)])
def test_bad_chat_requests_get_400_naming_the_field(tiny_server, body, param, needle):
    content = json.dumps(body).encode()  # (Python's json writes NaN and Infinity; httpx's refuses)
    response = httpx.post(f"{tiny_server[0]}/chat/completions", content=content, timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert error["type"] == "invalid_request_error" and "Traceback" not in response.text


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/completions", {"model": MODEL_NAME, "prompt": []}, "prompt: must be a string"),
    ("/completions", {"model": MODEL_NAME, "prompt": [[]]}, "none of them empty"),
    ("/completions", {"model": MODEL_NAME, "prompt": [10**6]}, "outside the vocabulary"),
    ("/completions", {"model": MODEL_NAME, "prompt": "hi", "echo": True}, "echo: not supported"),
    ("/completions", {"model": MODEL_NAME, "prompt": "hi", "logprobs": 6}, "less than or equal to 5"),
    ("/completions", {"model": MODEL_NAME, "prompt": "x " * 300, "max_tokens": 1}, "context is 256 tokens"),
    ("/embeddings", {"model": MODEL_NAME, "input": ""}, "empty after tokenisation"),
    ("/embeddings", {"model": MODEL_NAME, "input": "hi", "dimensions": 7}, "have 48 dimensions"),
    ("/embeddings", {"model": MODEL_NAME, "input": "hi", "encoding_format": "int8"}, "'float' or 'base64'"),
])
def test_bad_completion_and_embedding_requests_get_400(tiny_server, path, body, needle):
    response = httpx.post(f"{tiny_server[0]}{path}", json=body, timeout=10)
    assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text


@pytest.mark.parametrize(("content", "needle"), [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"", "the body is empty"),
])
def test_bodies_that_are_not_json_objects_get_400(tiny_server, content, needle):
    response = httpx.post(f"{tiny_server[0]}/chat/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text


def test_a_huge_body_is_refused_before_it_is_read(tiny_server):
    url = f"{tiny_server[0]}/completions"
    host, port = httpx.URL(url).host, httpx.URL(url).port
    with socket.create_connection((host, port), timeout=10) as raw:  # declares 1 GiB, sends none of it
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1073741824\r\n\r\n")
        assert raw.recv(4096).startswith(b"HTTP/1.1 413")
    chunks = (b" " * (1 << 20) for _ in range(17))  # chunked: no declared length, 17 MiB of spaces
    streamed = httpx.post(url, content=chunks, timeout=30, headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "over 16 MiB" in streamed.json()["error"]["message"]


def test_a_request_larger_than_the_server_is_400_naming_the_limit_and_echoes_little(tiny_server):
    """More prompts than slots + queue could ever hold is not "busy, retry" (429) but a 400 naming
    the limit; error messages show at most a short prefix of what the client sent."""
    url = tiny_server[0]
    prompts = ["hi"] * 500  # the tiny server: 4 slots + the default queue of 64
    response = httpx.post(f"{url}/completions", json={"model": MODEL_NAME, "prompt": prompts, "max_tokens": 1},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "500 prompts in one request" in error["message"], error
    assert "at most 68 requests at once" in error["message"] and "--max-queue" in error["message"]
    huge = "m" * 100_000
    missing = httpx.post(f"{url}/chat/completions", json={**CHAT, "model": huge}, timeout=10)
    assert missing.status_code == 404 and len(missing.text) < 1_000, missing.text[:300]
    long_path = httpx.get(f"{url}/{'x' * 50_000}", timeout=10)
    assert long_path.status_code == 404 and len(long_path.text) < 1_000


def test_unknown_routes_and_methods(tiny_server):
    url = tiny_server[0]
    missing = httpx.get(f"{url}/engines", timeout=10)
    assert missing.status_code == 404 and "no route GET /v1/engines" in missing.json()["error"]["message"]
    assert httpx.delete(f"{url}/models", timeout=10).status_code == 405


def test_the_openai_client_sees_its_own_error_types(tiny_server):
    client = openai.OpenAI(base_url=tiny_server[0], api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=10_000)
    assert info.value.code == "context_length_exceeded"


def test_the_api_key_is_required_when_set(tiny_dir):
    with live_server(tiny_state(tiny_dir, api_key="s3cret")) as url:
        for key in ("wrong", ""):
            client = openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0,
                                   default_headers={} if key else {"Authorization": ""})
            with pytest.raises(openai.AuthenticationError) as info:
                client.models.list()
            assert info.value.status_code == 401 and "--api-key" in info.value.message
        assert httpx.post(f"{url}/chat/completions", content=b"{bad", timeout=10).status_code == 401
        assert httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{url.removesuffix('/v1')}/health", timeout=10).status_code == 200
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=2).usage


@pytest.fixture(scope="module")
def slow_server(tiny_dir):
    """One slot, no waiting room, and a model slowed to ~20 ms a step: long answers stay running."""
    state = tiny_state(tiny_dir, max_batch=1, max_queue=0)
    step = state.engine.step
    state.steps = 0

    def slow_step():
        time.sleep(0.02)
        step()
        state.steps += 1

    state.engine.step = slow_step
    with live_server(state) as url:
        yield url, state


# An unseeded answer of the tiny random model can sample an early end-of-sequence token and finish
# inside the 25 steps these tests need it to run (CI saw one finish within a 0.5 s timeout): a fixed
# seed whose answer runs all 200 tokens keeps them deterministic (checked by the test below).
LONG_ANSWER_SEED = 7


def test_the_long_answer_seed_runs_long(tiny_dir):
    with live_server(tiny_state(tiny_dir)) as url:
        answer = httpx.post(f"{url}/chat/completions", json={**CHAT, "max_tokens": 200, "seed": LONG_ANSWER_SEED},
                            timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 200


def wait_for(condition, timeout=5.0) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_full_server_says_429_with_retry_after_and_a_gone_client_frees_its_slot(slow_server):
    url, state = slow_server
    engine = state.engine
    body = {**CHAT, "max_tokens": 200, "stream": True, "seed": LONG_ANSWER_SEED}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=10) as first:
        data = (line for line in first.iter_lines() if line.startswith("data:"))
        next(data), next(data)  # the role chunk, then a generated token: the request holds the slot
        assert engine.running == 1
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=5)
        retry = info.value.response.headers["retry-after"]
        assert retry.isdigit() and int(retry) >= 1 and info.value.code == "rate_limit_exceeded"
        steps = state.steps
    # The stream was closed mid-answer: the slot is free within a step or two (20 ms each).
    assert wait_for(lambda: engine.running == 0) < 1.0
    assert state.steps - steps <= 3
    assert int(engine.cache.lengths.sum()) == 0
    answer = httpx.post(f"{url}/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=10)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3


def test_a_client_that_leaves_a_whole_answer_frees_its_slot(slow_server):
    url, state = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/chat/completions", json={**CHAT, "max_tokens": 200, "seed": LONG_ANSWER_SEED},
                   timeout=0.5)
    assert wait_for(lambda: state.engine.running == 0) < 1.5
