"""The Responses API (``POST /v1/responses``) through the official openai client against a live
server: a tiny random model where the text does not matter (answers whole, async and streamed,
the same as the chat route's; structured output; a function call continued by its output through
``previous_response_id`` or the whole conversation; errors; the API key), the store's bound, and
SmolLM2-135M-Instruct (slow) answering and driving the OpenAI Agents SDK's default model."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from serve_helpers import live_server, tiny_text_model

from aiayn.serve import ServedModel, build_state
from aiayn.serve.responses import APIError
from aiayn.serve.responses_api import ResponseStore

KEY = "test-key"
TIMEOUT = 120  # seconds any one request may take
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}  # (a random model's numbers are short only so)
ADD = {"type": "function", "name": "add", "description": "The sum of two integers", "strict": True,
       "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                      "required": ["a", "b"], "additionalProperties": False}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def url():
    """A server over the tiny model (context 2,048: the tools' description is long in its small
    vocabulary) that wants the API key ``KEY``."""
    state, _ = build_state(ServedModel("tiny", lm=tiny_text_model(context=2048)), max_batch=4, context=2048,
                           api_key=KEY)
    with live_server(state) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=TIMEOUT)


def test_an_answer_is_the_chat_routes_answer_whole_async_and_streamed(url, client):
    kwargs = dict(model="tiny", instructions="Be brief.", input="Hello there", max_output_tokens=6, temperature=0)
    answer = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.instructions == "Be brief."
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text == chat.choices[0].message.content
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens, 6)

    async def async_answer() -> str:
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=TIMEOUT) as aclient:
            return (await aclient.responses.create(**kwargs)).output_text

    assert asyncio.run(asyncio.wait_for(async_answer(), TIMEOUT)) == answer.output_text
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert list(dict.fromkeys(kinds)) == [*TEXT_EVENTS, "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text
    last = events[-1].response
    assert last.output_text == answer.output_text and last.usage.output_tokens == 6


def test_a_json_schema_answer_validates(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "unit": {"enum": ["cm", "m"]}},
              "required": ["answer", "unit"], "additionalProperties": False}
    answer = client.responses.create(model="tiny", input="How long?", max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "length", "schema": schema, "strict": True}})
    assert answer.status == "completed" and answer.text.format.type == "json_schema"
    jsonschema.validate(json.loads(answer.output_text), schema)


def call_of(answer) -> tuple[str, str, str]:
    (call,) = [item for item in answer.output if item.type == "function_call"]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    return call.call_id, call.name, call.arguments


def test_a_call_continued_by_previous_response_id_and_by_the_whole_conversation(client):
    question = "What is 2 + 3?"
    answer = client.responses.create(model="tiny", input=question, tools=[ADD], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=60)
    call_id, name, arguments = call_of(answer)
    assert name == "add" and answer.status == "completed" and answer.tool_choice == "required"
    result = {"type": "function_call_output", "call_id": call_id, "output": "5"}
    follow = dict(model="tiny", tools=[ADD], tool_choice="none", max_output_tokens=5, temperature=0)
    by_id = client.responses.create(**follow, previous_response_id=answer.id, input=[result])
    whole = client.responses.create(**follow, input=[
        {"role": "user", "content": [{"type": "input_text", "text": question}]},
        {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}, result])
    assert by_id.previous_response_id == answer.id and by_id.output_text == whole.output_text
    assert by_id.usage.input_tokens == whole.usage.input_tokens
    again = client.responses.create(**follow, previous_response_id=by_id.id, input="And 3 + 4?")
    assert again.usage.input_tokens > by_id.usage.input_tokens + by_id.usage.output_tokens


def test_a_streamed_call_sends_its_arguments_as_they_come(client):
    events = list(client.responses.create(model="tiny", input="Add 1 and 2", tools=[ADD], max_output_tokens=60,
                                          tool_choice={"type": "function", "name": "add"}, stream=True))
    kinds = list(dict.fromkeys(e.type for e in events))
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert call_of(events[-1].response)[2] == done.arguments


@pytest.mark.parametrize(("kwargs", "status", "says"), [
    (dict(previous_response_id="resp_unknown"), 404, 'no response "resp_unknown" is stored'),
    (dict(input=[{"type": "reasoning", "summary": []}]), 400, "input.0: an input item is a message"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400,
     "input.0.content: only text parts"),
    (dict(include=["reasoning.encrypted_content"]), 400, "include: aiayn serve adds no optional parts"),
    (dict(tools=[ADD, ADD]), 400, "tools: each function needs its own name"),
    (dict(model="other"), 404, "the model 'other' does not exist"),
    (dict(max_output_tokens=5000), 400, "tokens + max_output_tokens 5000 = "),
    (dict(input="hi " * 3000), 400, "tokens + max_output_tokens 2 = "),
])
def test_bad_requests_are_openai_errors(client, kwargs, status, says):
    with pytest.raises(openai.APIStatusError) as error:
        client.responses.create(**{"model": "tiny", "input": "hi", "max_output_tokens": 2, **kwargs})
    assert error.value.status_code == status
    body = error.value.body
    assert set(body) == {"message", "type", "param", "code"} and says in body["message"], body
    assert "messages" not in body["message"] and body["param"] != "messages"


def test_an_answer_not_stored_cannot_be_continued(client):
    answer = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    assert answer.store is False
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model="tiny", input="more", max_output_tokens=2, previous_response_id=answer.id)
    assert error.value.body["code"] == "previous_response_not_found"


def test_a_stored_response_is_read_back_and_deleted(client):
    answer = client.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0)
    again = client.responses.retrieve(answer.id)
    assert again.model_dump() == answer.model_dump()
    streamed = client.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0, stream=True)
    completed = [event.response for event in streamed if event.type == "response.incomplete"]
    assert len(completed) == 1
    assert client.responses.retrieve(completed[0].id).model_dump() == completed[0].model_dump()
    client.responses.delete(answer.id)
    for read in (lambda: client.responses.retrieve(answer.id), lambda: client.responses.delete(answer.id),
                 lambda: client.responses.create(model="tiny", input="more", max_output_tokens=2,
                                                 previous_response_id=answer.id)):
        with pytest.raises(openai.NotFoundError) as error:
            read()
        assert f'no response "{answer.id}" is stored' in error.value.body["message"]


def test_an_answer_not_stored_cannot_be_read_back(client):
    answer = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.retrieve(answer.id)
    assert error.value.body["code"] == "not_found" and "store=false" in error.value.body["message"]


def test_the_api_key_is_required(url):
    stranger = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=TIMEOUT)
    for call in (lambda: stranger.responses.create(model="tiny", input="hi", max_output_tokens=2),
                 lambda: stranger.responses.retrieve("resp_x"), lambda: stranger.responses.delete("resp_x")):
        with pytest.raises(openai.AuthenticationError) as error:
            call()
        assert error.value.body["code"] == "invalid_api_key"


def test_the_store_keeps_the_latest_responses_used():
    store = ResponseStore(size=2)
    for name in ("a", "b"):
        store.put(name, [{"role": "user", "content": name}], {"id": name})
    store.get("a")  # a is now the latest used: b goes first
    store.put("c", [], {"id": "c"})
    assert store.get("a") == [{"role": "user", "content": "a"}] and store.get("c") == []
    with pytest.raises(APIError) as error:
        store.get("b")
    assert error.value.status == 404 and "the 2 latest" in error.value.message


@pytest.fixture(scope="module")
def smollm2_url(smollm2_text_model):
    state, _ = build_state(ServedModel("smollm2", lm=smollm2_text_model()), max_batch=2, context=2048)
    with live_server(state) as base:
        yield base


@pytest.mark.slow
def test_smollm2_answers_by_instructions(smollm2_url):
    client = openai.OpenAI(base_url=smollm2_url, api_key="unused", max_retries=0, timeout=TIMEOUT)
    answer = client.responses.create(model="smollm2", instructions="Answer in one short sentence.",
                                     input="What is the capital of France?", max_output_tokens=40, temperature=0)
    assert answer.status == "completed" and "Paris" in answer.output_text, answer.output_text


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_the_agents_sdk_default_model_runs_a_tool_on_smollm2_to_a_text_answer(smollm2_url, streamed):
    """The SDK's default model (``OpenAIResponsesModel``) asks, the server answers with a function
    call, the SDK runs the tool and sends its output back with the whole conversation, and the model
    answers in text; streamed, the text deltas the SDK passes on make up that answer. The tool is
    offered once: SmolLM2-135M, untrained for tools, calls an offered tool again rather than answer
    from its result (its template has no tool support, so the earlier call is JSON text in the
    prompt, and the model repeats it)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool(is_enabled=lambda context, agent: not cities)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return '{"temperature": 22, "sky": "sunny"}'

    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=smollm2_url, api_key="unused", max_retries=0, timeout=TIMEOUT) as aio:
            agent = agents.Agent(name="weather", model=agents.OpenAIResponsesModel(model="smollm2", openai_client=aio),
                                 tools=[get_weather], model_settings=agents.ModelSettings(temperature=0, max_tokens=60))
            question = "What is the weather like in Paris today?"
            if not streamed:
                return (await agents.Runner.run(agent, question, max_turns=3)).final_output
            result = agents.Runner.run_streamed(agent, question, max_turns=3)
            async for event in result.stream_events():
                if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
                    deltas.append(event.data.delta)
            return result.final_output

    deltas: list[str] = []
    final = asyncio.run(asyncio.wait_for(run(), 3 * TIMEOUT))
    assert cities == ["Paris"] and "Paris" in final and "tool_call" not in final, final
    assert not streamed or "".join(deltas) == final, deltas
