"""What agent libraries ask of ``aiayn serve``, on SmolLM2-135M-Instruct (4-bit, as ``aiayn serve
--quantize q4``): a schema-constrained answer with a number ends as valid JSON well inside its token
limit (``constrain.BOUNDS`` caps the number's digits), through the official client and through
pydantic-ai; and a tool loop with tool_choice "auto" ends with a text answer: after a tool's result
the grammar still allows text, the prompt is the model's own template token for token (as
transformers renders it), and the model answers instead of calling again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from serve_helpers import live_server
from tokenizer_helpers import grammar_accepts

from aiayn.serve import ServedModel, build_state
from aiayn.serve.tool_calls import tool_format
from aiayn.serve.tools import (
    Tool,
    _add_system,
    generic_instructions,
    render_chat,
    template_messages,
    template_support,
    tool_settings,
)

pytestmark = pytest.mark.slow

CITY = {"type": "object", "title": "City", "additionalProperties": False,
        "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                       "population_millions": {"type": "number"}},
        "required": ["city", "country", "population_millions"]}
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = {"role": "user", "content": "What is the weather in Quito?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Quito"}'}}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "It is sunny in Quito."}
ROUNDS = 4  # a loop that has not answered by then never will


@pytest.fixture(scope="module")
def smollm2(smollm2_text_model):
    return smollm2_text_model("q4")


@pytest.fixture(scope="module")
def served(smollm2):
    """(base URL, openai client) of one server over SmolLM2 in 4 bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    state, _ = build_state(ServedModel("smollm2", lm=smollm2), max_batch=2, context=2048)
    with live_server(state) as url:
        yield url, openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served_float32(smollm2_text_model):
    """An openai client of a server over SmolLM2 in float32 (``aiayn serve``'s default)."""
    state, _ = build_state(ServedModel("smollm2", lm=smollm2_text_model()), max_batch=2, context=2048)
    with live_server(state) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


def test_city_schema_ends_as_json_within_80_tokens_through_the_openai_client(served):
    """Unbounded, this model writes 3.8288888... until max_tokens; capped, the answer is whole."""
    _, client = served
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe Paris."}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": CITY, "strict": True}})
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens <= 80
    jsonschema.validate(json.loads(answer.choices[0].message.content), CITY)
    cut = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe Paris."}], max_tokens=8, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": CITY}})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 8


def test_city_schema_through_pydantic_ai(served):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        city: str
        country: str
        population_millions: float

    url, _ = served
    model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=url, api_key="unused"))
    agent = pydantic_ai.Agent(model, output_type=pydantic_ai.NativeOutput(City),
                              model_settings={"max_tokens": 80, "temperature": 0, "timeout": 300})
    result = agent.run_sync("Describe Paris.")
    assert isinstance(result.output, City) and result.usage.output_tokens <= 80


def test_after_a_tool_result_auto_allows_text_and_the_prompt_is_the_templates_own(smollm2):
    """The grammar of "auto" takes a text answer after a tool's result as before it; the prompt's
    tokens are transformers' ``apply_chat_template`` of the same messages (the tools described in
    the system message, the call as the assistant's JSON: the template renders neither itself)."""
    transformers = pytest.importorskip("transformers")
    from aiayn.interop.gguf import smollm2_path

    path = Path(smollm2_path())
    settings = tool_settings([Tool.model_validate(WEATHER)], "auto", None)
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL]}, RESULT]
    _, constraint = tool_format(smollm2, settings)
    tokenizer = smollm2.tokenizer
    assert grammar_accepts(constraint, tokenizer, '{"response": "It is sunny in Quito."}')
    assert grammar_accepts(constraint, tokenizer, '{"tool_calls": [{"name": "weather", "arguments": {"city": "Quito"}}]}')
    assert not grammar_accepts(constraint, tokenizer, "It is sunny in Quito.")  # the generic layout: text is JSON too
    prompt = render_chat(smollm2.chat_template, messages, settings)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    adapted = _add_system(template_messages(messages, template_support(smollm2.chat_template), settings.parallel),
                          generic_instructions(settings, True))
    expected = reference.apply_chat_template(adapted, tools=list(settings.tools), tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    assert ids == list(expected)
    # The tool's result is the template's own "tool" turn, as transformers renders the raw messages.
    own = reference.apply_chat_template([{**m, "content": m["content"] or ""} for m in messages], tokenize=False,
                                        add_generation_prompt=True)
    tail = "<|im_start|>tool\nIt is sunny in Quito.<|im_end|>\n<|im_start|>assistant\n"
    assert own.endswith(tail) and prompt.endswith(tail)


def test_a_tool_loop_with_auto_ends_with_a_text_answer(served_float32):
    """The loop pydantic-ai runs: call, result, call again ... Greedy SmolLM2 in float32 calls the
    tool once, then answers from its result (in 4 bits, near a tie, it may call again)."""
    client = served_float32
    messages: list[dict] = [QUESTION]
    for _ in range(ROUNDS):
        answer = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER],
                                                tool_choice="auto", max_tokens=60, temperature=0).choices[0]
        if not answer.message.tool_calls:
            break
        messages.append(answer.message.model_dump(exclude_none=True))
        messages += [{**RESULT, "tool_call_id": call.id} for call in answer.message.tool_calls]
    assert not answer.message.tool_calls and answer.finish_reason == "stop", messages
    assert answer.message.content and len(messages) == 3, messages


def test_a_pydantic_ai_agent_with_one_tool_ends_with_a_text_answer(served_float32):
    """pydantic-ai's own loop (it offers the tool on every turn, with tool_choice "auto"): SmolLM2 in
    float32 calls the tool once, reads its result and answers in text."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=str(served_float32.base_url),
                                                               api_key="unused"))
    agent = pydantic_ai.Agent(model, model_settings={"max_tokens": 60, "temperature": 0, "timeout": 300})
    cities: list[str] = []

    @agent.tool_plain
    def weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return RESULT["content"]

    result = agent.run_sync(QUESTION["content"], usage_limits=pydantic_ai.UsageLimits(request_limit=ROUNDS))
    assert cities == ["Quito"] and isinstance(result.output, str) and result.output, (cities, result.output)
