"""Tool calls in ``aiayn serve``: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
and the prompt the model's own chat template makes of them.

* The request's side: ``Tool`` (a function: name, description, parameters as a JSON schema,
  strict), ``NamedToolChoice``, the ``ToolCall`` an assistant message carries back, strict pydantic
  models as ``aiayn.serve.schemas``'; ``tool_settings`` checks them together (a named function
  that is not among the tools, ``tool_choice`` without tools, ...) into one ``ToolSettings``.
* The prompt: ``render_chat`` renders the messages through the model's chat template. A template
  that uses ``tools`` (one that writes a tool's name given one) gets them as it expects them
  (transformers' ``apply_chat_template(tools=...)``: OpenAI's tool objects). For a template
  without tool support (SmolLM2's), the tool descriptions are injected as llama.cpp's "generic"
  handling does (minja's polyfill): a system message listing the tools as JSON with an example
  call and the answer's form; an assistant message's ``tool_calls`` become its content in that
  form, a ``role: "tool"`` message becomes a user message ``{"tool_response": {...}}``. What a
  template supports is found by rendering probes (as minja does), once per template.
* How the answer is laid out and constrained, and read back into ``tool_calls``:
  ``aiayn.serve.tool_calls``.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's rule for function names (letters, digits, underscores and dashes, at most 64).
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128  # as OpenAI


class _Strict(BaseModel):  # as aiayn.serve.schemas.Strict (which imports this module)
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object (None: no arguments)
    strict: bool | None = None  # the schema is always enforced, strict or not


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(_Strict):
    """A call in an assistant message sent back with the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


def call_id() -> str:
    """A new tool call's id, in OpenAI's form ("call_" and 24 letters and digits)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolSettings:
    """A request's tools as the answer uses them: ``tools`` (OpenAI's objects, as dicts), which of
    them the answer may call (``choice``: "auto" text or calls, "required" at least one call;
    ``names``: the callable ones, one for a named choice), and whether several calls may come in
    one answer. Each function's ``parameters`` is an object schema."""

    tools: tuple[dict[str, Any], ...]
    choice: Literal["auto", "required"]
    names: tuple[str, ...]
    parallel: bool

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"]["parameters"]
        raise KeyError(name)


def object_schema(parameters: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """A function's parameters as the object schema its arguments follow: None is no arguments
    (``{"type": "object", "properties": {}}``, as OpenAI), a schema without a type gets "object";
    ValueError for a schema of another type (OpenAI's arguments are always a JSON object)."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ValueError(f"{where}: the arguments of a function are a JSON object; give a schema of "
                         f'"type": "object", not {json.dumps(kind)}')
    return {**parameters, "type": "object"}


def tool_settings(tools: list[Tool] | None, tool_choice: ToolChoice | None,
                  parallel_tool_calls: bool | None) -> ToolSettings | None:
    """The request's tools checked together; None when the answer is plain text (no tools, or
    ``tool_choice`` "none"). ValueError, one line naming the field, for a bad combination."""
    if not tools:
        if tools is not None:
            raise ValueError("tools: give at least one tool, or leave tools out")
        for name, value in (("tool_choice", tool_choice), ("parallel_tool_calls", parallel_tool_calls)):
            if value is not None:
                raise ValueError(f"{name}: only allowed when tools are given")
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    names = [t.function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools: each function needs its own name; {', '.join(twice)} is given more than once")
    dumped = []
    for i, tool in enumerate(tools):
        data = tool.model_dump(exclude_none=True)
        data["function"]["parameters"] = object_schema(tool.function.parameters, f"tools[{i}].function.parameters")
        dumped.append(data)
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {json.dumps(choice.function.name)}; the tools are "
                             f"{', '.join(names)}")
        return ToolSettings(tuple(dumped), "required", (choice.function.name,), False)
    return ToolSettings(tuple(dumped), choice, tuple(names), parallel_tool_calls is not False)


# ---- what a chat template supports ---------------------------------------------------------------
@dataclass(frozen=True)
class TemplateSupport:
    """Which tool messages a chat template renders itself (found by probes, as minja does):
    ``tools`` (it writes a tool it is given), ``tool_calls`` (an assistant message's calls),
    ``tool_responses`` (``role: "tool"`` messages), and whether it writes Hermes' ``<tool_call>``
    tags (Qwen2.5, Hermes 2/3: the model answers in them)."""

    tools: bool
    tool_calls: bool
    tool_responses: bool
    hermes: bool


_PROBE_TOOL = {"type": "function", "function": {
    "name": "aiayn_probe_tool", "description": "a probe", "parameters": {"type": "object", "properties": {
        "aiayn_probe_argument": {"type": "string"}}, "required": ["aiayn_probe_argument"]}}}
_PROBE_CALL = {"id": "call_aiayn_probe_id", "type": "function", "function": {
    "name": "aiayn_probe_call", "arguments": {"aiayn_probe_argument": "aiayn_probe_value"}}}
_supports: dict[str, TemplateSupport] = {}
_supports_lock = threading.Lock()


def _renders(template: Any, messages: list[dict[str, Any]], needle: str, **variables: Any) -> bool:
    try:
        return needle in template.render(messages, **variables)
    except Exception:  # any failure of a probe means "not supported"
        return False


def template_support(template: Any) -> TemplateSupport:
    """What ``template`` (a ``ChatTemplate``) supports, probed once per template source."""
    key = str(template)
    with _supports_lock:
        if key in _supports:
            return _supports[key]
    user = {"role": "user", "content": "hi"}
    calling = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    answer = {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "content": "aiayn_probe_result"}
    tools = _renders(template, [user], "aiayn_probe_tool", tools=[_PROBE_TOOL])
    support = TemplateSupport(
        tools=tools,
        tool_calls=_renders(template, [user, calling], "aiayn_probe_call"),
        tool_responses=_renders(template, [user, calling, answer], "aiayn_probe_result"),
        hermes=tools and "<tool_call>" in key)
    with _supports_lock:
        _supports[key] = support
    return support


# ---- rendering a conversation with tools ----------------------------------------------------------
def _arguments_object(arguments: str) -> Any:
    """A call's arguments as templates read them: the JSON object (as vLLM passes them), or the
    text as it is when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def generic_calls_text(calls: list[dict[str, Any]], many: bool | None) -> str:
    """Calls as the generic format writes them (what ``aiayn.serve.tool_calls`` asks the model
    for): ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` where several calls may come
    (``many``; None: where there are several), else ``{"tool_call": {...}}``."""
    items = [{"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}
             for c in calls]
    many = len(items) > 1 if many is None else many or len(items) > 1
    body = {"tool_calls": items} if many else {"tool_call": items[0]}
    return json.dumps(body, ensure_ascii=False)


def generic_instructions(settings: ToolSettings) -> str:
    """The system text that describes the tools to a template without tool support: llama.cpp's
    generic handling's (the tools as indented JSON, an example call, the answer's form), with the
    example in the exact form the grammar then asks for."""
    example = {"name": "tool_name", "arguments": {"arg1": "some_value"}}
    key, sample = (("tool_calls", {"tool_calls": [example]}) if settings.parallel
                   else ("tool_call", {"tool_call": example}))
    what = f"`{key}` (a request to call tools)"
    if settings.choice == "auto":
        form = f"Respond in JSON format, either with {what} or with `response` reply to the user's request"
    elif len(settings.names) == 1:
        form = f"Respond in JSON format with {what}, calling `{settings.names[0]}`"
    else:
        form = f"Respond in JSON format with {what}"
    listed = json.dumps(list(settings.tools), indent=2, ensure_ascii=False)
    return (f"{form}\n\nYou can call any of the following tools to satisfy the user's requests: {listed}\n\n"
            f"Example tool call syntax:\n\n{json.dumps(sample, ensure_ascii=False)}")


def _add_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` appended to the first system message, or a system message of its own first."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_messages(messages: list[dict[str, Any]], support: TemplateSupport,
                      many: bool | None = None) -> list[dict[str, Any]]:
    """The request's messages (``model_dump``ed, OpenAI's shape) as the template reads them: null
    content is "" (templates concatenate it), a call's arguments are its JSON object; for a
    template without support for them, calls become the assistant's content and tool results user
    messages, in the generic format (``many``: as ``generic_calls_text``; the tool's name found
    from the call's id)."""
    names = {}
    out = []
    for message in messages:
        message = {**message, "content": message.get("content") or ""}
        calls = message.get("tool_calls")
        if calls:
            names.update({c["id"]: c["function"]["name"] for c in calls})
            if support.tool_calls:
                message["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments_object(
                    c["function"]["arguments"])}} for c in calls]
            else:
                text = generic_calls_text(calls, many)
                message = {"role": "assistant", "content": f"{message['content']}\n{text}".lstrip("\n")}
        elif message["role"] == "tool" and not support.tool_responses:
            response = {"tool": names.get(message.get("tool_call_id", "")), "content": message["content"],
                        "tool_call_id": message.get("tool_call_id")}
            message = {"role": "user", "content": json.dumps(
                {"tool_response": {k: v for k, v in response.items() if v is not None}}, ensure_ascii=False)}
        out.append(message)
    return out


def render_chat(template: Any, messages: list[dict[str, Any]], settings: ToolSettings | None) -> str:
    """The prompt for ``messages`` with the request's tools (None: a plain chat, any calls and tool
    results in the history still rendered). Raises the template's InteropError when it refuses."""
    if settings is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return template.render(messages)
    support = template_support(template)
    adapted = template_messages(messages, support, None if settings is None else settings.parallel)
    if settings is None:
        return template.render(adapted)
    if support.hermes:
        return template.render(adapted, tools=list(settings.tools))
    adapted = _add_system(adapted, generic_instructions(settings))
    # A template that lists tools its own way gets them too (llama.cpp passes them to any template).
    return template.render(adapted, **({"tools": list(settings.tools)} if support.tools else {}))

