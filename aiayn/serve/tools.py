"""Tool calls, the request's side: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as
strict pydantic models, checked together by ``tool_settings``, and the prompt the chat template
makes of them (``render_chat``; a template without tool support gets llama.cpp's "generic" text)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128  # as OpenAI


class Strict(BaseModel):
    """A request model: unknown fields are refused, and so are values of the wrong type."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object (None: no arguments)
    strict: bool | None = None  # the schema is always enforced, strict or not


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Strict):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(Strict):
    """A call in an assistant message sent back with the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


def call_id() -> str:
    """A new tool call's id, in OpenAI's form."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolSettings:
    """A request's tools as the answer uses them: ``tools`` (dicts), ``choice`` ("auto" or
    "required"), the callable ``names`` and whether one answer may hold several calls."""

    tools: tuple[dict[str, Any], ...]
    choice: Literal["auto", "required"]
    names: tuple[str, ...]
    parallel: bool

    def parameters(self, name: str) -> dict[str, Any]:
        return next(t["function"]["parameters"] for t in self.tools if t["function"]["name"] == name)


def object_schema(parameters: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """A function's parameters as an object schema (None: no arguments); ValueError for another type."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ValueError(f"{where}: the arguments of a function are a JSON object; give a schema of "
                         f'"type": "object", not {json.dumps(kind)}')
    return {**parameters, "type": "object"}


def tool_settings(tools: list[Tool] | None, tool_choice: ToolChoice | None,
                  parallel_tool_calls: bool | None) -> ToolSettings | None:
    """The request's tools checked together (None: a plain text answer); ValueError naming the field."""
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
    """What a chat template renders itself (found by probes, as minja does)."""

    tools: bool
    tool_calls: bool
    tool_responses: bool
    hermes: bool


_PROBE_TOOL = {"type": "function", "function": {
    "name": "aiayn_probe_tool", "description": "a probe", "parameters": {"type": "object", "properties": {
        "aiayn_probe_argument": {"type": "string"}}, "required": ["aiayn_probe_argument"]}}}
_PROBE_CALL = {"id": "call_aiayn_probe_id", "type": "function", "function": {
    "name": "aiayn_probe_call", "arguments": {"aiayn_probe_argument": "aiayn_probe_value"}}}
_supports: dict[str, TemplateSupport] = {}  # (two threads may probe one template at once: the same answer)


def _renders(template: Any, messages: list[dict[str, Any]], needle: str, **variables: Any) -> bool:
    try:
        return needle in template.render(messages, **variables)
    except Exception:  # any failure of a probe means "not supported"
        return False


def template_support(template: Any) -> TemplateSupport:
    """What ``template`` (a ``ChatTemplate``) supports, probed once per template source."""
    key = str(template)
    if key in _supports:
        return _supports[key]
    user = {"role": "user", "content": "hi"}
    calling = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    answer = {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "content": "aiayn_probe_result"}
    tools = _renders(template, [user], "aiayn_probe_tool", tools=[_PROBE_TOOL])
    support = _supports[key] = TemplateSupport(
        tools=tools,
        tool_calls=_renders(template, [user, calling], "aiayn_probe_call"),
        tool_responses=_renders(template, [user, calling, answer], "aiayn_probe_result"),
        hermes=tools and "<tool_call>" in key)
    return support


# ---- rendering a conversation with tools ----------------------------------------------------------
def _arguments_object(arguments: str) -> Any:
    """A call's arguments as templates read them: the JSON object (as vLLM), else the text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def generic_calls_text(calls: list[dict[str, Any]], many: bool | None) -> str:
    """Calls in the generic format: ``{"tool_calls": [...]}`` where several may come, else ``{"tool_call": {...}}``."""
    items = [{"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}
             for c in calls]
    body = {"tool_calls": items} if many or len(items) > 1 else {"tool_call": items[0]}
    return json.dumps(body, ensure_ascii=False)


RESPONSE_EXAMPLE = '{"response": "..."}'  # the generic layout's text answer, shown beside the call


def generic_instructions(settings: ToolSettings, results: bool = False) -> str:
    """The system text describing the tools to a template without tool support (llama.cpp's). With
    "auto" and tool ``results`` in the conversation it shows the text answer's syntax too: shown
    only the call's, a small model (SmolLM2-135M) never writes ``{"response": ...}`` and calls the
    tool again after each result (shown before any result, it answers without calling)."""
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
    answer = f"\n\nExample response syntax:\n\n{RESPONSE_EXAMPLE}" if settings.choice == "auto" and results else ""
    return (f"{form}\n\nYou can call any of the following tools to satisfy the user's requests: {listed}\n\n"
            f"Example tool call syntax:\n\n{json.dumps(sample, ensure_ascii=False)}{answer}")


def _add_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` appended to the first system message, or a system message of its own first."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_messages(messages: list[dict[str, Any]], support: TemplateSupport,
                      many: bool | None = None) -> list[dict[str, Any]]:
    """The messages as the template reads them; where it lacks support, calls become the assistant's
    content and tool results user messages, in the generic format."""
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
    """The prompt for ``messages`` with the request's tools; the template's InteropError when it refuses."""
    if settings is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return template.render(messages)
    support = template_support(template)
    adapted = template_messages(messages, support, None if settings is None else settings.parallel)
    if settings is None:
        return template.render(adapted)
    if support.hermes:
        return template.render(adapted, tools=list(settings.tools))
    adapted = _add_system(adapted, generic_instructions(settings, any(m["role"] == "tool" for m in messages)))
    return template.render(adapted, **({"tools": list(settings.tools)} if support.tools else {}))

