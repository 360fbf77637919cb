"""A tool-calling answer: its layout, the grammar that holds the model to it, and reading it back
into OpenAI's ``tool_calls``. Two layouts, as llama.cpp's: Hermes (``<tool_call>{...}</tool_call>``
blocks, for templates that write them) and generic JSON (``{"tool_call": {...}}``,
``{"tool_calls": [...]}`` or ``{"response": "text"}``), compact with the name first."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aiayn.generate.constrain import (
    BOUNDS,
    JSON_OPTIONS,
    GrammarConstraint,
    JsonBounds,
    bounded_schema,
)
from aiayn.serve.tools import ToolSettings, call_id, template_support

TRIGGER, CLOSE = "<tool_call>", "</tool_call>"  # Hermes: the text that starts a call, and ends it


@dataclass(frozen=True)
class Layout:
    """What comes before the first call object, ``between`` two (None: one call only), after the last."""

    first: str
    between: str | None
    last: str


HERMES = Layout("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>")
GENERIC_ONE = Layout('{"tool_call": ', None, "}")
GENERIC_MANY = Layout('{"tool_calls": [', ", ", "]}")
RESPONSE = '{"response": '  # the generic layout's text answer: this, a JSON string, "}"

_HEAD = re.compile(r'\{"name": "([a-zA-Z0-9_-]{1,64})", "arguments": ')  # a call object up to its arguments
_decoder = json.JSONDecoder()
_lark = json.dumps  # a Lark string literal (JSON's escapes)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text so far
    complete: bool  # the arguments object is whole


@dataclass
class Parsed:
    """An answer read so far: its text ``content`` (None: none, only calls) and its calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def _json(schema: dict[str, Any]) -> str:
    """``%json {...}``: an inline JSON schema."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


class ToolFormat:
    """One request's tool-call format: its ``grammar``, the ``constraint`` a generation follows, and
    ``parse`` of what the model wrote; ``response_schema``: the schema of a text answer."""

    def __init__(self, settings: ToolSettings, *, hermes: bool, response_schema: dict[str, Any] | None = None,
                 bounds: JsonBounds | None = BOUNDS) -> None:
        self.settings, self.hermes, self.response_schema, self.bounds = settings, hermes, response_schema, bounds
        layout = HERMES if hermes else (GENERIC_MANY if settings.parallel else GENERIC_ONE)
        self.layout = layout if settings.parallel else Layout(layout.first, None, layout.last)

    def call_schema(self) -> dict[str, Any]:
        """One call object: ``{"name": <a callable function>, "arguments": <its parameters>}``, the
        parameters within ``bounds`` where they leave a value open."""
        options = [{"type": "object", "properties": {"name": {"const": name},
                                                     "arguments": bounded_schema(self.settings.parameters(name), self.bounds)},
                    "required": ["name", "arguments"], "additionalProperties": False} for name in self.settings.names]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def grammar(self, tag_tokens: bool = False) -> str:
        """The answer's grammar; ``tag_tokens``: the tokenizer has Hermes' tags as added tokens (Qwen2.5)."""
        layout = self.layout
        if self.hermes and tag_tokens:
            return self._hermes_token_grammar()
        more = f" ({_lark(layout.between)} call)*" if layout.between is not None else ""
        lines = [f"call: {_json(self.call_schema())}"]
        calls = f"{_lark(layout.first)} call{more} {_lark(layout.last)}"
        answer = None if self.response_schema is None else f"answer: {_json(bounded_schema(self.response_schema, self.bounds))}"
        if self.settings.choice == "required":
            lines.insert(0, f"start: {calls}")
        elif self.hermes and answer is not None:  # a JSON answer or calls
            lines[:0] = [f"start: answer | {calls}", answer]
        elif self.hermes:  # free text, or text up to the trigger and then calls
            rest = layout.first.removeprefix(TRIGGER)
            lines[:0] = [f"start: TEXT | head {_lark(rest)} call{more} {_lark(layout.last)}",
                         "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
                         "head[lazy]: /(?s:.*)<tool_call>/"]
        else:  # a {"response": ...} object or the calls
            lines[:0] = [f'start: {calls} | {_lark(RESPONSE)} answer "}}"',
                         answer or f"answer: {_json({'type': 'string'})}"]
        return "\n".join(lines) + "\n"

    def _hermes_token_grammar(self) -> str:
        """Hermes with its tags as tokens: text spelling the tag out is refused."""
        block = f'{TRIGGER} "\\n" call "\\n" {CLOSE}'  # (<name> in Lark: the token)
        calls = f'{block} ("\\n" {block})*' if self.layout.between is not None else block
        if self.settings.choice == "required":
            start, text = "calls", []
        elif self.response_schema is not None:
            start, text = "answer | calls", [f"answer: {_json(bounded_schema(self.response_schema, self.bounds))}"]
        else:
            start, text = "TEXT | TEXT calls | calls", ["TEXT: /(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/"]
        return "\n".join([f"start: {start}", f"calls: {calls}", f"call: {_json(self.call_schema())}", *text]) + "\n"

    def constraint(self, tokenizer: Any, eos_id: int | None) -> GrammarConstraint:
        """A fresh grammar state for one answer; ValueError when llguidance refuses a schema."""
        return GrammarConstraint.from_lark(tokenizer, self.grammar(self.hermes and tags_are_tokens(tokenizer)),
                                           eos_id=eos_id)

    # ---- reading the answer ----------------------------------------------------------------------
    def parse(self, text: str, final: bool) -> Parsed:
        """What ``text`` says so far; not ``final`` (streaming), text that may yet start a call is held back."""
        layout = self.layout
        if self.hermes and self.response_schema is not None:  # JSON (which may hold the tag in a string) or calls
            if text.startswith(TRIGGER):
                return Parsed(None, _calls(text, 0, layout))
            return Parsed(text if final or not TRIGGER.startswith(text) else "")
        if self.hermes:
            start = text.find(TRIGGER)
            if start < 0:
                return Parsed(text if final else _held_back(text))
            return Parsed(text[:start].rstrip() or None, _calls(text, start, layout))
        if text.startswith(layout.first):
            return Parsed(None, _calls(text, 0, layout))
        if text.startswith(RESPONSE) and self.response_schema is not None:  # the JSON value's text
            return Parsed(_value_so_far(text, len(RESPONSE)))
        if text.startswith(RESPONSE):
            return Parsed(_string_so_far(text, len(RESPONSE)))
        return Parsed("")  # (a prefix of either, or a cut answer)

    def finish_reason(self, parsed: Parsed, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an answer that ended with whole calls."""
        if engine_reason == "stop" and parsed.calls and parsed.calls[-1].complete:
            return "tool_calls"
        return engine_reason


def tags_are_tokens(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (a ``tokenizers.Tokenizer``) has both Hermes tags as added tokens."""
    if not hasattr(tokenizer, "get_added_tokens_decoder"):
        return False
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    return TRIGGER in added and CLOSE in added


def _held_back(text: str) -> str:
    """Streamed Hermes text without a tail that may yet start ``<tool_call>``, and trailing space."""
    for size in range(min(len(TRIGGER) - 1, len(text)), 0, -1):
        if TRIGGER.startswith(text[-size:]):
            text = text[:-size]
            break
    return text.rstrip()


def _calls(text: str, start: int, layout: Layout) -> list[ParsedCall]:
    """The calls written from ``start`` on (where ``layout.first`` begins)."""
    if not text.startswith(layout.first, start):
        return []
    at = start + len(layout.first)
    calls: list[ParsedCall] = []
    while (head := _HEAD.match(text, at)) is not None:
        try:
            _, end = _decoder.raw_decode(text, head.end())
        except ValueError:  # not complete yet (or cut): everything after the head is arguments
            calls.append(ParsedCall(head[1], text[head.end():], False))
            break
        calls.append(ParsedCall(head[1], text[head.end(): end], True))
        at = end + 1  # past the call object's closing brace
        if layout.between is None or not text.startswith(layout.between, at):
            break
        at += len(layout.between)
    return calls


def _value_so_far(text: str, start: int) -> str:
    """The text of the JSON value that starts at ``start``: up to its end once whole, else all of it."""
    try:
        return text[start: _decoder.raw_decode(text, start)[1]]
    except ValueError:
        return text[start:]


def _string_so_far(text: str, start: int) -> str:
    """The JSON string at ``start``, decoded as far as it is written."""
    try:
        value, _ = _decoder.raw_decode(text, start)
        return value if isinstance(value, str) else ""
    except ValueError:
        pass
    body = text[start:]
    for cut in range(min(7, len(body))):  # \uXXXX is the longest escape: 6 characters
        try:
            value = json.loads(body[: len(body) - cut] + '"')
        except ValueError:
            continue
        return value[:-1] if value and "\ud800" <= value[-1] <= "\udbff" else value
    return ""


def message(fmt: ToolFormat, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's (content, tool_calls in OpenAI's form, each with a new id)."""
    parsed = fmt.parse(text, final=True)
    return parsed.content, [{"id": call_id(), "type": "function",
                             "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]


class ToolStream:
    """A streamed answer's deltas as OpenAI sends them: text content, then per call its id and name,
    then its arguments as they are written."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.content = ""  # sent so far
        self.arguments: list[str] = []  # each call's arguments sent so far
        self.parsed = Parsed("")

    def add(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        self.text += piece
        self.parsed = parsed = self.fmt.parse(self.text, final)
        deltas: list[dict[str, Any]] = []
        content = parsed.content or ""
        if len(content) > len(self.content):
            deltas.append({"content": content[len(self.content):]})
            self.content = content
        for index, call in enumerate(parsed.calls):
            if index == len(self.arguments):
                self.arguments.append("")
                deltas.append({"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            sent = self.arguments[index]
            if len(call.arguments) > len(sent):
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments[len(sent):]}}]})
                self.arguments[index] = call.arguments
        return deltas

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self.fmt.finish_reason(self.parsed, engine_reason)


def answer_message(fmt: ToolFormat, text: str, engine_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer's assistant message and its finish reason."""
    content, calls = message(fmt, text)
    reply: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        reply["tool_calls"] = calls
    return reply, fmt.finish_reason(fmt.parse(text, final=True), engine_reason)


def tool_format(lm: Any, settings: ToolSettings, response_schema: dict[str, Any] | None = None,
                bounds: JsonBounds | None = BOUNDS) -> tuple[ToolFormat, GrammarConstraint]:
    """The request's format for ``lm`` (Hermes where the template writes ``<tool_call>``, else
    generic) and its compiled grammar, off the event loop; ValueError for a refused schema."""
    fmt = ToolFormat(settings, hermes=template_support(lm.chat_template).hermes, response_schema=response_schema,
                     bounds=bounds)
    return fmt, fmt.constraint(lm.tokenizer, lm.eos_id)
