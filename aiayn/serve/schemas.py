"""The OpenAI request bodies ``aiayn serve`` accepts, as strict pydantic models: no type
conversion, finite numbers in range, unknown fields and unimplemented OpenAI options refused by
name. ``validation_message`` turns pydantic's errors into the one line of the 400 answer."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator

from aiayn.serve.tools import FUNCTION_NAME, Strict, Tool, ToolCall, ToolChoice, tool_settings

MAX_STOPS = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 128  # n, as OpenAI
MAX_LOGIT_BIAS = 300  # entries of logit_bias
SEED_LIMIT = 2**63  # seeds in [0, 2**63)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's defaults when a request leaves them out
DEFAULT_TOP_P = 1.0
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions

Probability = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
PositiveInt = Annotated[int, Field(ge=1)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]


def _strings(value: Any) -> Any:
    """A string or a list of strings -> a list of strings (other types: a clear error)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _texts_or_token_lists(value: Any) -> Any:
    """OpenAI's prompt / input (a string, token ids, or a list of either) -> a non-empty list of them."""
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)

    if isinstance(value, str) or is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or is_ids(v) for v in value):
        return value
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of such lists "
                     "(none of them empty)")


def _content(value: Any) -> Any:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f"only text content parts ({{'type': 'text', 'text': '...'}}) are supported, "
                                 f"got {sorted(part)} of type {part.get('type')!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError("must be a string or a list of text parts")


class StreamOptions(Strict):
    include_usage: bool = False


class Message(Strict):
    """A chat message. An assistant's may carry ``tool_calls`` (content then may be null) and a
    ``refusal`` (ignored); a ``role: "tool"`` message answers the call ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, BeforeValidator(_content)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _by_role(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: is required in a message of role {self.role} (null only beside an assistant's "
                             f"tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers (and only it has one)")
        return self


class JSONSchemaSpec(Strict):
    """``response_format.json_schema``: enforced whatever ``strict`` says (none: any JSON value)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class GenerationRequest(Strict):
    """What chat and completion requests share; ``repetition_penalty``, ``top_k`` (vLLM's names) and
    ``response_format`` on completions are extensions."""

    model: str
    temperature: Temperature | None = None
    top_p: Probability | None = None
    max_tokens: PositiveInt | None = None
    stop: Annotated[list[str], BeforeValidator(_strings)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    top_k: PositiveInt | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> GenerationRequest:
        bad = [key for key in self.logit_bias or {} if not key.isascii() or not key.isdigit()]
        if bad:
            raise ValueError(f"logit_bias: keys are token ids written as strings (\"50256\"), got {bad[0]!r}")
        if self.stop is not None and (len(self.stop) > MAX_STOPS or "" in self.stop):
            raise ValueError(f"stop: give at most {MAX_STOPS} stop strings, none of them empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tokens_and_logprobs(self) -> ChatCompletionRequest:
        tool_settings(self.tools, self.tool_choice, self.parallel_tool_calls)  # (ValueError naming the field)
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError("max_tokens: differs from max_completion_tokens; give one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: Annotated[list[str | list[int]], BeforeValidator(_texts_or_token_lists)]
    max_tokens: PositiveInt | None = COMPLETION_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None

    @model_validator(mode="after")
    def _completion_options(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported by aiayn serve; leave it out")
        if self.suffix:
            raise ValueError("suffix: not supported by aiayn serve (no fill-in-the-middle); leave it out")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: not supported by aiayn serve; leave it out or give 1")
        return self


class EmbeddingRequest(Strict):
    model: str
    input: Annotated[list[str | list[int]], BeforeValidator(_texts_or_token_lists)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None


MAX_MESSAGE_ERRORS = 3
ITEM_KINDS = ("message", "function_call", "function_call_output")  # the tags of the Responses API's input items


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic / FastAPI validation errors -> (one line naming each bad field, the first field)."""
    parts, first = [], None
    for error in errors[:MAX_MESSAGE_ERRORS]:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        loc = [p for i, p in enumerate(loc) if not (i and loc[i - 1].isdigit() and p in ITEM_KINDS)]  # (union tags)
        field = ".".join(loc)
        message = str(error.get("msg", "is not valid")).removeprefix("Value error, ")
        kind = error.get("type", "")
        if kind == "extra_forbidden":
            message = "unknown field (not part of the API, or not supported by aiayn serve); leave it out"
        elif kind == "missing" and not field:
            message = "the body is empty; send a JSON object"
        elif kind == "missing":
            message = "is required"
        elif kind == "json_invalid":
            ctx = error.get("ctx") or {}
            message = f"the body is not valid JSON ({ctx.get('error', 'parse error')})"
            field = ""
        elif not field and kind in ("model_attributes_type", "dict_type", "model_type"):
            message = "the body must be a JSON object (sent with Content-Type: application/json)"
        elif "input" in error and kind not in ("value_error",) and not isinstance(error["input"], dict | list):
            message = f"{message} (got {error['input']!r})"
        named = re.match(r"([a-z_]+): ", message)
        if not field and named:  # a check of the whole request names its field itself
            field = named[1]
            parts.append(message)
        else:
            parts.append(f"{field}: {message}" if field else message)
        first = first or field or None
    more = len(errors) - MAX_MESSAGE_ERRORS
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else ""), first


# ---- the Responses API (/v1/responses): its request, read into a chat request by responses_api ----
def _item_text(value: Any) -> Any:
    """An input item's text: a string, or a list of input_text / output_text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = []
        for part in value:
            if part.get("type") not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                raise ValueError(f"only text parts ({{'type': 'input_text', 'text': '...'}}) are supported, got a "
                                 f"part of type {part.get('type')!r}")
            if set(part) - {"type", "text", "annotations", "logprobs"}:
                raise ValueError(f"a text part has only type and text, got {sorted(part)}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError("must be a string or a list of input_text parts")


ItemText = Annotated[str, BeforeValidator(_item_text)]


class ItemFields(Strict):
    """What every input item may carry back from an earlier answer: its id and status."""

    id: str | None = None
    status: str | None = None


class InputMessage(ItemFields):
    """A message item (``type`` may be left out): the user's, the instructions', or an earlier answer."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: ItemText


class FunctionCallItem(ItemFields):
    """A call the model made, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(ItemFields):
    """The result of the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: ItemText


def _input_items(value: Any) -> Any:
    """``input``: a string is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None) or "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind, custom_error_type="input_item",
                  custom_error_message="an input item is a message (role and content), a function_call or a "
                                       "function_call_output; other item types are not supported by aiayn serve")]


class FunctionTool(Strict):
    """A function tool in the Responses API's flat form."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is always enforced, strict or not


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class JSONSchemaText(Strict):
    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


TextFormatParam = Annotated[TextFormat | JSONObjectFormat | JSONSchemaText, Field(discriminator="type")]


class TextOptions(Strict):
    format: TextFormatParam | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without that training has


class ResponsesRequest(Strict):
    """``POST /v1/responses``; ``include`` may only be empty (the answer has no optional parts)."""

    model: str
    input: Annotated[list[InputItem], Field(min_length=1), BeforeValidator(_input_items)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _nothing_to_include(self) -> ResponsesRequest:
        if self.include:
            raise ValueError("include: aiayn serve adds no optional parts to an answer; leave include out or give []")
        return self
