"""Tool calls without a server (aiayn.serve.tools, aiayn.serve.tool_calls): the request's tools
checked together, the prompt each kind of chat template gets (SmolLM2's, without tool support, by
llama.cpp's generic injection; a Hermes/Qwen2.5-style one with its own), the grammar of each
tool_choice (valid answers taken, invalid ones refused), the answer read back whole and as
OpenAI's streamed deltas, and a tiny random model's sampled answers under the grammar, every one
valid against the function's schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from serve_helpers import TEXT, tiny_text_model
from tokenizer_helpers import train_tokenizer

from aiayn.generate.constrain import ConstraintError, generate_constrained
from aiayn.generate.sampling import SamplingConfig
from aiayn.interop.gguf_text import ChatTemplate
from aiayn.serve.tool_calls import ToolFormat, ToolStream, message
from aiayn.serve.tools import NamedToolChoice, Tool, render_chat, template_support, tool_settings

FIXTURES = Path(__file__).parent / "fixtures"
HERMES_TEMPLATE = (FIXTURES / "hermes_tools.jinja").read_text()
# SmolLM2-135M-Instruct's chat template, as its GGUF file holds it (no tool support).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}, "strict": True}}
CALL_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CALL_ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def tools(*specs: dict) -> list[Tool]:
    return [Tool.model_validate(s) for s in specs]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXT)


# ---- the request's tools -------------------------------------------------------------------------
def test_tool_settings_defaults_and_choices():
    settings = tool_settings(tools(WEATHER, ADD), None, None)
    assert (settings.choice, settings.names, settings.parallel) == ("auto", ("get_weather", "add"), True)
    assert settings.parameters("add") == ADD["function"]["parameters"]
    assert tool_settings(tools(WEATHER, ADD), "required", False).parallel is False
    one = tool_settings(tools(WEATHER, ADD), named("add"), None)
    assert (one.choice, one.names, one.parallel) == ("required", ("add",), False)
    assert tool_settings(tools(WEATHER), "none", None) is None
    assert tool_settings(None, None, None) is None
    no_parameters = tool_settings(tools({"type": "function", "function": {"name": "ping"}}), None, None)
    assert no_parameters.parameters("ping") == {"type": "object", "properties": {}}
    assert "strict" not in no_parameters.tools[0]["function"]  # (None fields are left out of the prompt)


@pytest.mark.parametrize(("given", "message_part"), [
    (dict(tools=None, tool_choice="auto", parallel_tool_calls=None), "tool_choice: only allowed when tools are given"),
    (dict(tools=None, tool_choice=None, parallel_tool_calls=True), "parallel_tool_calls: only allowed"),
    (dict(tools=[], tool_choice=None, parallel_tool_calls=None), "tools: give at least one tool"),
    (dict(tools=[WEATHER, WEATHER], tool_choice=None, parallel_tool_calls=None), "get_weather is given more than once"),
    (dict(tools=[WEATHER], tool_choice=named("add"), parallel_tool_calls=None), 'no tool is named "add"'),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], tool_choice=None,
          parallel_tool_calls=None), 'tools[0].function.parameters: the arguments of a function are a JSON object'),
])
def test_tool_settings_refuse_bad_combinations_in_one_line(given, message_part):
    given["tools"] = None if given["tools"] is None else tools(*given["tools"])
    with pytest.raises(ValueError, match=message_part.replace("[", r"\[").replace("]", r"\]")) as error:
        tool_settings(**given)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("bad", [
    {"type": "function", "function": {"name": "has space"}},
    {"type": "function", "function": {"name": "x" * 65}},
    {"type": "retrieval", "function": {"name": "f"}},
    {"type": "function", "function": {"name": "f", "parameters": "not a schema"}},
    {"type": "function", "function": {"name": "f", "unknown": 1}},
])
def test_tool_objects_are_strict(bad):
    with pytest.raises(ValueError):
        Tool.model_validate(bad)


# ---- the prompt --------------------------------------------------------------------------------
def test_template_support_is_probed():
    smol = template_support(ChatTemplate(SMOLLM2_TEMPLATE))
    assert (smol.tools, smol.tool_calls, smol.hermes) == (False, False, False)
    assert smol.tool_responses  # it writes any role's content (llama.cpp's probe says the same)
    hermes = template_support(ChatTemplate(HERMES_TEMPLATE))
    assert (hermes.tools, hermes.tool_calls, hermes.tool_responses, hermes.hermes) == (True, True, True, True)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_a_template_without_tools_gets_them_as_llama_cpp_generic_handling_injects_them():
    settings = tool_settings(tools(WEATHER), "auto", False)
    prompt = render_chat(ChatTemplate(SMOLLM2_TEMPLATE), HISTORY, settings)
    listed = json.dumps([WEATHER], indent=2)
    expected = (
        "<|im_start|>system\nRespond in JSON format, either with `tool_call` (a request to call tools) or with "
        f"`response` reply to the user's request\n\nYou can call any of the following tools to satisfy the user's "
        f"requests: {listed}\n\nExample tool call syntax:\n\n"
        '{"tool_call": {"name": "tool_name", "arguments": {"arg1": "some_value"}}}\n\n'
        'Example response syntax:\n\n{"response": "..."}<|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f'<|im_start|>assistant\n{{"tool_call": {CALL_WEATHER}}}<|im_end|>\n'
        '<|im_start|>tool\n{"temperature": 21}<|im_end|>\n'
        "<|im_start|>assistant\n")
    assert prompt == expected
    # "required", several calls: the instruction and the history's calls take the tool_calls form.
    many = render_chat(ChatTemplate(SMOLLM2_TEMPLATE), HISTORY, tool_settings(tools(WEATHER, ADD), "required", True))
    assert "Respond in JSON format with `tool_calls` (a request to call tools)\n" in many
    assert "Example response syntax" not in many  # "required": no text answer to show
    first = render_chat(ChatTemplate(SMOLLM2_TEMPLATE), HISTORY[:1], settings)  # no tool result yet: llama.cpp's text
    assert first.startswith(expected.split("\n\nExample response")[0] + "<|im_end|>\n<|im_start|>user\n")
    assert f'<|im_start|>assistant\n{{"tool_calls": [{CALL_WEATHER}]}}<|im_end|>' in many
    # A system message keeps its text first; tool_choice "none": no tools, the history still rendered.
    system = render_chat(ChatTemplate(SMOLLM2_TEMPLATE), [{"role": "system", "content": "Be brief."}, *HISTORY],
                         settings)
    assert system.startswith("<|im_start|>system\nBe brief.\n\nRespond in JSON format")
    plain = render_chat(ChatTemplate(SMOLLM2_TEMPLATE), HISTORY, None)
    assert "Respond in JSON" not in plain and f'{{"tool_call": {CALL_WEATHER}}}' in plain


def test_a_template_without_tool_responses_gets_them_as_user_messages():
    """A template that knows only user and assistant (a tool message would break it) gets tool
    results as llama.cpp's polyfill writes them: a user turn {"tool_response": {...}}."""
    strict_roles = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                    "{{ raise_exception('unknown role') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert not template_support(ChatTemplate(strict_roles)).tool_responses
    prompt = render_chat(ChatTemplate(strict_roles), HISTORY, None)
    expected = {"tool_response": {"tool": "get_weather", "content": '{"temperature": 21}', "tool_call_id": "call_1"}}
    assert f"<|im_start|>user\n{json.dumps(expected)}<|im_end|>\n<|im_start|>assistant\n" in prompt


def test_a_template_with_tool_support_renders_tools_calls_and_results_itself():
    settings = tool_settings(tools(WEATHER, ADD), None, None)
    prompt = render_chat(ChatTemplate(HERMES_TEMPLATE), HISTORY, settings)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n{json.dumps(ADD)}\n</tools>" in prompt
    assert "Respond in JSON" not in prompt  # the template's own instructions, nothing injected
    assert (f"<|im_start|>assistant\n<tool_call>\n{CALL_WEATHER}\n</tool_call><|im_end|>\n"  # arguments as an object
            '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n'
            "<|im_start|>assistant\n") in prompt


# ---- the grammar of each choice ----------------------------------------------------------------
CASES = [  # (hermes, tool_choice, parallel_tool_calls, answer, accepted)
    (False, "auto", False, f'{{"tool_call": {CALL_WEATHER}}}', True),
    (False, "auto", False, '{"response": "It is \\"sunny\\"."}', True),
    (False, "auto", False, 'It is sunny.', False),
    (False, "auto", True, f'{{"tool_calls": [{CALL_WEATHER}, {CALL_ADD}]}}', True),
    (False, "required", True, '{"response": "no"}', False),
    (False, "required", False, f'{{"tool_call": {CALL_ADD}}}', True),
    (False, "required", False, '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": "2"}}}', False),
    (False, "required", False, '{"tool_call": {"name": "sub", "arguments": {"a": 1, "b": 2}}}', False),
    (False, named("add"), None, f'{{"tool_call": {CALL_WEATHER}}}', False),
    (False, named("add"), None, f'{{"tool_call": {CALL_ADD}}}', True),
    (True, "auto", True, "Plain text, even with <tool and </tool_call> in it.", True),
    (True, "auto", True, f"Let me look.\n<tool_call>\n{CALL_WEATHER}\n</tool_call>", True),
    (True, "auto", False, f"<tool_call>\n{CALL_WEATHER}\n</tool_call>\n<tool_call>\n{CALL_ADD}\n</tool_call>", False),
    (True, "auto", True, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', False),
    (True, "required", True, f"<tool_call>\n{CALL_WEATHER}\n</tool_call>\n<tool_call>\n{CALL_ADD}\n</tool_call>", True),
    (True, "required", False, f"Sure.\n<tool_call>\n{CALL_ADD}\n</tool_call>", False),
    (True, named("get_weather"), None, f"<tool_call>\n{CALL_WEATHER}\n</tool_call>", True),
]


def follows(constraint, tokenizer, text: str) -> bool:
    """Whether the grammar takes every token of ``text`` and the text is a whole answer."""
    try:
        for token in tokenizer.encode(text, add_special_tokens=False).ids:
            constraint.advance(token)
    except ConstraintError:
        return False
    return constraint.is_complete()


@pytest.mark.parametrize(("hermes", "choice", "parallel", "answer", "accepted"), CASES)
def test_the_grammar_takes_valid_answers_only(tokenizer, hermes, choice, parallel, answer, accepted):
    fmt = ToolFormat(tool_settings(tools(WEATHER, ADD), choice, parallel), hermes=hermes)
    eos = tokenizer.token_to_id("<|im_end|>")
    assert follows(fmt.constraint(tokenizer, eos), tokenizer, answer) == accepted


def test_a_call_is_complete_without_asking_the_model_to_end(tokenizer):
    """Where nothing can follow (one call asked for), the grammar says finished: the engine stops."""
    eos = tokenizer.token_to_id("<|im_end|>")
    for hermes, answer in ((False, f'{{"tool_call": {CALL_ADD}}}'), (True, f"<tool_call>\n{CALL_ADD}\n</tool_call>")):
        constraint = ToolFormat(tool_settings(tools(ADD), "required", False), hermes=hermes).constraint(tokenizer, eos)
        assert follows(constraint, tokenizer, answer) and constraint.is_finished()


def test_hermes_tags_as_tokens_of_their_own(tokenizer):
    """Qwen2.5's tokenizer has <tool_call> and </tool_call> as tokens of their own (added, not
    special): the grammar takes them, and forces them in a required call."""
    qwen_like = train_tokenizer(TEXT)
    qwen_like.add_tokens(["<tool_call>", "</tool_call>"])
    eos = qwen_like.token_to_id("<|im_end|>")
    answer = f"Sure.\n<tool_call>\n{CALL_ADD}\n</tool_call>"
    assert qwen_like.token_to_id("<tool_call>") in qwen_like.encode(answer, add_special_tokens=False).ids
    assert follows(ToolFormat(tool_settings(tools(ADD), "auto", None), hermes=True).constraint(qwen_like, eos),
                   qwen_like, answer)
    required = ToolFormat(tool_settings(tools(ADD), "required", None), hermes=True).constraint(qwen_like, eos)
    assert required.allowed().nonzero().flatten().tolist() == [qwen_like.token_to_id("<tool_call>")]


def test_an_unusable_parameters_schema_is_one_clear_error(tokenizer):
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["x"]}}}
    with pytest.raises(ValueError, match="invalid grammar") as error:
        ToolFormat(tool_settings(tools(broken), "required", None), hermes=False).constraint(tokenizer, 2)
    assert "\n" not in str(error.value)


# ---- reading the answer back ---------------------------------------------------------------------
READ = [  # (hermes, choice, parallel, answer, content, [(name, arguments)])
    (False, "auto", False, '{"response": "It is \\"sunny\\" \\u00e9\\ud83d\\ude00."}', 'It is "sunny" é😀.', []),
    (False, "auto", True, f'{{"tool_calls": [{CALL_WEATHER}, {CALL_ADD}]}}', None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 1, "b": 2}')]),
    (False, "required", False, f'{{"tool_call": {CALL_ADD}}}', None, [("add", '{"a": 1, "b": 2}')]),
    (True, "auto", True, "No call here < <tool really.\n", "No call here < <tool really.\n", []),
    (True, "auto", True, f"Let me look.\n<tool_call>\n{CALL_WEATHER}\n</tool_call>\n<tool_call>\n{CALL_ADD}\n"
                         "</tool_call>", "Let me look.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 1, "b": 2}')]),
    (True, "required", False, f"<tool_call>\n{CALL_ADD}\n</tool_call>", None, [("add", '{"a": 1, "b": 2}')]),
]


def streamed(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """(content, [(name, arguments)], deltas) put together from the deltas of ``pieces`` streamed."""
    stream = ToolStream(fmt)
    deltas = [d for i, piece in enumerate(pieces) for d in stream.add(piece, final=i == len(pieces) - 1)]
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["id"].startswith("call_") and call["type"] == "function"
                calls.append([call["function"]["name"], call["function"]["arguments"]])
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(c) for c in calls], deltas


@pytest.mark.parametrize(("hermes", "choice", "parallel", "answer", "content", "calls"), READ)
def test_an_answer_read_whole_and_streamed_alike(tokenizer, hermes, choice, parallel, answer, content, calls):
    fmt = ToolFormat(tool_settings(tools(WEATHER, ADD), choice, parallel), hermes=hermes)
    whole_content, whole_calls = message(fmt, answer)
    assert whole_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == calls
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function" for c in whole_calls)
    ids = tokenizer.encode(answer, add_special_tokens=False).ids
    for pieces in ([tokenizer.decode([t]) for t in ids], list(answer), [answer, ""]):  # by token, character, at once
        got_content, got_calls, deltas = streamed(fmt, pieces)
        assert (got_content or None, got_calls) == (content, calls)
        assert all(d.get("content", "x") != "" for d in deltas)  # no empty deltas


def test_text_that_may_start_a_call_is_held_back_while_streaming():
    fmt = ToolFormat(tool_settings(tools(ADD), "auto", None), hermes=True)
    stream = ToolStream(fmt)
    assert stream.add("Let me add. <tool") == [{"content": "Let me add."}]  # the space and "<tool" wait
    assert stream.add("box>") == [{"content": " <toolbox>"}]  # not a call after all
    first = stream.add(f"\n<tool_call>\n{CALL_ADD[:30]}")
    assert first[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": CALL_ADD[29:30]}}]}


def test_a_cut_answer_gives_what_was_written():
    fmt = ToolFormat(tool_settings(tools(ADD), "required", None), hermes=False)
    cut = '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b'
    content, calls = message(fmt, cut)
    assert content is None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b'}
    parsed = fmt.parse(cut, final=True)
    assert fmt.finish_reason(parsed, "length") == "length"
    whole = fmt.parse(f'{{"tool_calls": [{CALL_ADD}]}}', final=True)
    assert fmt.finish_reason(whole, "stop") == "tool_calls"
    assert fmt.finish_reason(ToolFormat(fmt.settings, hermes=True).parse("just text", True), "stop") == "stop"


ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                 "additionalProperties": False}


@pytest.mark.parametrize(("hermes", "answer", "content", "calls"), [
    (False, '{"response": {"answer": 5}}', '{"answer": 5}', []),
    (False, '{"response": "five"}', None, None),
    (False, f'{{"tool_calls": [{CALL_ADD}]}}', None, [("add", '{"a": 1, "b": 2}')]),
    (True, '{"answer": 5}', '{"answer": 5}', []),
    (True, "Plain text.", None, None),
    (True, f"<tool_call>\n{CALL_ADD}\n</tool_call>", None, [("add", '{"a": 1, "b": 2}')]),
])
def test_a_response_format_holds_the_text_answer_beside_tools(tokenizer, hermes, answer, content, calls):
    """response_format with tool_choice "auto": the text answer is JSON valid against its schema
    (generic: the "response" value; Hermes: the whole answer, else calls), read back as content."""
    fmt = ToolFormat(tool_settings(tools(ADD), "auto", None), hermes=hermes, response_schema=ANSWER_SCHEMA)
    eos = tokenizer.token_to_id("<|im_end|>")
    assert follows(fmt.constraint(tokenizer, eos), tokenizer, answer) == (calls is not None)
    if calls is None:
        return
    whole_content, whole_calls = message(fmt, answer)
    assert (whole_content, [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]) == (content, calls)
    got_content, got_calls, _ = streamed(fmt, [tokenizer.decode([t]) for t in tokenizer.encode(answer).ids])
    assert (got_content or None, got_calls) == (content, calls)


# ---- a model's answers under the grammar -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm():
    return tiny_text_model(context=2048)  # (the generic system text is long in a 320-token vocabulary)


@pytest.mark.parametrize(("hermes", "choice", "parallel"), [
    (False, "auto", False), (False, "required", True), (False, named("add"), None),
    (True, "auto", True), (True, "required", False), (True, named("get_weather"), None)])
def test_a_random_models_sampled_calls_are_valid_against_the_schemas(tiny_lm, hermes, choice, parallel):
    """Whatever a random model samples, every call it makes names a tool it may call, with
    arguments that validate against that tool's parameters (jsonschema); a required call is made."""
    settings = tool_settings(tools(WEATHER, ADD), choice, parallel)
    fmt = ToolFormat(settings, hermes=hermes)
    template = ChatTemplate(HERMES_TEMPLATE if hermes else SMOLLM2_TEMPLATE)
    prompt = render_chat(template, [{"role": "user", "content": "Paris weather, and 2 + 3?"}], settings)
    made = 0
    for seed in range(4):
        constraint = fmt.constraint(tiny_lm.tokenizer, tiny_lm.eos_id)
        result = generate_constrained(tiny_lm, prompt, constraint, max_new_tokens=120, chat=False,
                                      sampling=SamplingConfig(temperature=1.0, seed=seed))
        _, calls = message(fmt, result.text)
        if choice != "auto":
            assert calls, result.text
        for call in calls[: len(calls) - (result.stop == "length")]:  # (a cut last call is not whole)
            name = call["function"]["name"]
            assert name in settings.names
            jsonschema.validate(json.loads(call["function"]["arguments"]), settings.parameters(name))
            made += 1
    assert made or choice == "auto"


@pytest.mark.parametrize("hermes", [False, True])
def test_a_character_level_model_is_one_clear_error(hermes):
    fmt = ToolFormat(tool_settings(tools(ADD), "required", None), hermes=hermes)
    with pytest.raises(ValueError, match="needs a model with a `tokenizers` tokenizer"):
        fmt.constraint(None, None)
