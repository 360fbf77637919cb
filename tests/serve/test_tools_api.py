"""Tool calls through the official openai client against a live server, whole and streamed: a
tiny random model behind a template without tool support (the generic format) and behind a
Hermes/Qwen2.5-style one, the conversation sent back with the calls' results, the errors; and
SmolLM2-135M-Instruct (slow), whose calls validate against the functions' schemas."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import openai
import pytest
from serve_helpers import live_server, tiny_text_model
from test_tools import ADD, HERMES_TEMPLATE, WEATHER

from aiayn.interop.gguf_text import ChatTemplate
from aiayn.serve import ServedModel, build_state

PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
QUESTION = [{"role": "user", "content": "What is 2 + 3, and the weather in Paris?"}]


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def servers():
    """{"generic": url, "hermes": url}: the tiny model behind its own template (no tool support)
    and behind the Hermes-style one; a context of 2,048 tokens (the tools' descriptions are long
    in a 320-token vocabulary)."""
    lm = tiny_text_model(context=2048)
    hermes = dataclasses.replace(lm, chat_template=ChatTemplate(HERMES_TEMPLATE, {"eos_token": "<|im_end|>"}))
    urls = {}
    with live_server(build_state(ServedModel("tiny", lm=lm), max_batch=4, context=2048)[0]) as urls["generic"], \
            live_server(build_state(ServedModel("tiny", lm=hermes), max_batch=4, context=2048)[0]) as urls["hermes"]:
        yield urls


def streamed(chunks) -> tuple[str | None, list[dict], str | None]:
    """(content, calls, finish_reason) put together from a stream's chunks, as a client does."""
    content, calls, finish = None, [], None
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function"
                calls.append({"id": call.id, "name": call.function.name, "arguments": call.function.arguments})
            else:
                calls[call.index]["arguments"] += call.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish


def check_calls(calls: list[dict], allowed: set[str]) -> None:
    for call in calls:
        assert call["name"] in allowed and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


@pytest.mark.parametrize("kind", ["generic", "hermes"])
@pytest.mark.parametrize(("choice", "parallel"), [("required", False), ({"type": "function", "function": {
    "name": "add"}}, None), ("required", True)])
def test_calls_whole_and_streamed_are_the_same_and_valid(servers, kind, choice, parallel):
    client = client_for(servers[kind])
    kwargs = dict(model="tiny", messages=QUESTION, tools=[WEATHER, ADD], tool_choice=choice, max_tokens=150,
                  temperature=1.0, seed=3, **({} if parallel is None else {"parallel_tool_calls": parallel}))
    answer = client.chat.completions.create(**kwargs).choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in answer.message.tool_calls]
    assert calls and answer.message.content is None
    if answer.finish_reason == "length":  # (several calls: a random model may go on calling)
        calls = calls[:-1]
    else:
        assert answer.finish_reason == "tool_calls"
    check_calls(calls, {"add"} if isinstance(choice, dict) else {"add", "get_weather"})
    content, streamed_calls, finish = streamed(client.chat.completions.create(**kwargs, stream=True))
    strip = [{k: v for k, v in c.items() if k != "id"} for c in answer.message.model_dump()["tool_calls"]]
    assert (content, finish) == (None, answer.finish_reason)
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed_calls] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in strip]


def test_n_answers_each_read_into_their_own_calls(servers):
    """n=2: each choice its own grammar state and its own calls, streamed under its own index."""
    client = client_for(servers["hermes"])
    kwargs = dict(model="tiny", messages=QUESTION, tools=[WEATHER, ADD], tool_choice="required", n=2, seed=11,
                  parallel_tool_calls=False, max_tokens=150, temperature=1.0)
    whole = client.chat.completions.create(**kwargs).choices
    assert [c.index for c in whole] == [0, 1]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for choice in whole:
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
        assert choice.finish_reason == "tool_calls" and len(calls) == 1
        check_calls(calls, {"add", "get_weather"})
        mine = [c for c in chunks if c.choices and c.choices[0].index == choice.index]
        content, streamed_calls, finish = streamed(mine)
        assert (content, finish) == (None, "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c["name"], c["arguments"]) for c in calls]


def test_auto_answers_text_or_calls_and_takes_the_results_back(servers):
    """tool_choice "auto" (the default with tools) on the Hermes template: free text or calls; the
    answer's message is sent back as it came, with a tool result, and the next answer comes."""
    client = client_for(servers["hermes"])
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER, ADD], max_tokens=40,
                                                temperature=1.0, seed=seed).choices[0]
        calls = answer.message.tool_calls or []
        assert answer.finish_reason in ("stop", "length", "tool_calls")
        assert (answer.finish_reason == "tool_calls") == (bool(calls) and answer.finish_reason != "length")
        assert "<tool_call>" not in (answer.message.content or "")
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    for sent in (answer.message, {"role": "assistant", "content": None, "tool_calls": [call]}):
        messages = [*QUESTION, sent, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
        for kind in ("generic", "hermes"):
            again = client_for(servers[kind]).chat.completions.create(
                model="tiny", messages=messages, tools=[WEATHER, ADD], tool_choice="none", max_tokens=5, seed=0)
            assert again.choices[0].message.tool_calls is None and again.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["generic", "hermes"])
def test_a_response_format_holds_the_text_answer_beside_tools(servers, kind):
    """tools with response_format: each answer is calls or JSON valid against the schema."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    client = client_for(servers[kind])
    checked = 0
    for seed in range(4):
        answer = client.chat.completions.create(
            model="tiny", messages=QUESTION, tools=[WEATHER, ADD], max_tokens=60, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}).choices[0]
        if answer.message.tool_calls:
            check_calls([{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                         for c in answer.message.tool_calls[: None if answer.finish_reason != "length" else -1]],
                        {"add", "get_weather"})
            checked += answer.finish_reason == "tool_calls"
        elif answer.finish_reason == "stop":
            jsonschema.validate(json.loads(answer.message.content), schema)
            checked += 1
    assert checked  # (whether a random model calls or answers is its own)


@pytest.mark.parametrize(("kwargs", "says"), [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "add"}}), 'no tool is named "add"'),
    (dict(tool_choice="required"), "tool_choice: only allowed when tools are given"),
    (dict(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "strin"}}}), "response_format: invalid JSON schema"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools.0.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "minLength": 3, "maxLength": 1}},
        "required": ["x"]}}}]),
     "tools: invalid grammar"),
    (dict(messages=[*QUESTION, {"role": "tool", "content": "5"}]), "tool_call_id: a tool message needs"),
    (dict(messages=[*QUESTION, {"role": "assistant", "content": None}]), "content: is required in a message of role assistant"),
])
def test_bad_tool_requests_are_one_clear_400(servers, kwargs, says):
    client = client_for(servers["generic"])
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": "tiny", "messages": QUESTION, "max_tokens": 4, **kwargs})
    message = error.value.body["message"]
    assert says in message and "\n" not in message and "Traceback" not in message


@pytest.mark.slow
def test_smollm2_calls_tools_valid_against_their_schemas_whole_and_streamed(smollm2_text_model):
    state, _ = build_state(ServedModel("smollm2", lm=smollm2_text_model()), max_batch=2, context=1024)
    with live_server(state) as url:
        client = client_for(url)
        kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                      tools=[WEATHER, ADD], max_tokens=60, temperature=0)
        answer = client.chat.completions.create(**kwargs).choices[0]
        assert answer.finish_reason == "tool_calls", answer.message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in answer.message.tool_calls]
        check_calls(calls, {"add", "get_weather"})
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["city"] == "Paris"
        content, streamed_calls, finish = streamed(client.chat.completions.create(**kwargs, stream=True))
        assert content is None and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
            (c["name"], c["arguments"]) for c in calls]
