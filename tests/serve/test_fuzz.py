"""No request body makes the server fail: any JSON value in any field of a chat or completion
request gets an answer or a 4xx in OpenAI's error format, never a 500 or a traceback."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import MODEL_NAME

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8,
)
CHAT_FIELDS = ["model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "stream",
               "stream_options", "seed", "n", "logprobs", "top_logprobs", "presence_penalty", "user", "tools", "tool_choice", "parallel_tool_calls",
               "logit_bias", "frequency_penalty", "repetition_penalty", "top_k", "response_format"]
COMPLETION_FIELDS = ["prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of", "stop", "seed"]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=json.dumps(body).encode(), timeout=30,
                      headers={"content-type": "application/json"})


def check(response: httpx.Response) -> None:
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and "Traceback" not in response.text


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(CHAT_FIELDS), value=JSON)
def test_any_value_in_any_chat_field(tiny_server, field, value):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    check(post(tiny_server[0], "/chat/completions", body))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(COMPLETION_FIELDS), value=JSON)
def test_any_value_in_any_completion_field(tiny_server, field, value):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, field: value}
    check(post(tiny_server[0], "/completions", body))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=JSON)
def test_any_json_body(tiny_server, body):
    check(post(tiny_server[0], "/chat/completions", body))
