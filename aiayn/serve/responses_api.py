"""OpenAI's Responses API (``POST /v1/responses``) over the chat route: a Responses request is read
into a chat request (one request model, two wire formats), the chat answer, whole or as streamed
chunks, is written back as a Response object or as Responses' events, and stored answers continue
a conversation through ``previous_response_id``."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import ValidationError

from aiayn.serve.responses import APIError
from aiayn.serve.schemas import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    ChatCompletionRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    ResponsesRequest,
    TextOptions,
    validation_message,
)

MAX_STORED = 256  # responses kept for previous_response_id, the least recently used dropped first


class ResponseStore:
    """The last ``size`` responses: each one's Response object and its conversation (without the
    instructions, which OpenAI does not carry over to the next turn)."""

    def __init__(self, size: int = MAX_STORED) -> None:
        self.size = size
        self._kept: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation up to and with the answer ``response_id``; 404 when it is not kept."""
        if response_id not in self._kept:
            raise APIError(404, f"previous_response_id: no response {json.dumps(response_id)} is stored on this "
                                f"server (an unknown id, an answer given with store=false, or one of more than the "
                                f"{self.size} latest, which are all it keeps); send the whole conversation as input",
                           code="previous_response_not_found", param="previous_response_id")
        self._kept.move_to_end(response_id)
        return self._kept[response_id][0]

    def response(self, response_id: str) -> dict[str, Any]:
        """The stored Response object ``response_id``; 404 when it is not kept."""
        return self._kept[self._known(response_id)][1]

    def delete(self, response_id: str) -> dict[str, Any]:
        """Forget ``response_id``: what ``DELETE /v1/responses/{id}`` answers; 404 when it is not kept."""
        del self._kept[self._known(response_id)]
        return {"id": response_id, "object": "response", "deleted": True}

    def _known(self, response_id: str) -> str:
        if response_id not in self._kept:
            raise APIError(404, f"no response {json.dumps(response_id)} is stored on this server (an unknown id, "
                                f"an answer given with store=false, a deleted one, or one of more than the "
                                f"{self.size} latest, which are all it keeps)", code="not_found")
        return response_id

    def put(self, response_id: str, conversation: list[dict[str, Any]], response: dict[str, Any]) -> None:
        self._kept[response_id] = (conversation, response)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


# ---- the request: a chat request -------------------------------------------------------------
def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """The input items as chat messages: a function call joins the assistant message just before it
    (its text, or calls before it), a call's output becomes a ``tool`` message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            assert isinstance(item, InputMessage)
            messages.append({"role": item.role, "content": item.content})
    return messages


def response_format(text: TextOptions | None) -> dict[str, Any] | None:
    """``text.format`` as the chat request's ``response_format`` (None: free text)."""
    fmt = None if text is None else text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}


def chat_request(body: ResponsesRequest, store: ResponseStore) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request that answers ``body`` and the conversation it continues (the new input in,
    the instructions out); 404 for an unknown ``previous_response_id``."""
    history = [] if body.previous_response_id is None else store.get(body.previous_response_id)
    conversation = [*history, *input_messages(body.input)]
    system = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    choice = body.tool_choice
    if not body.tools and choice in ("auto", "none"):  # (no tools: an empty list, as the Agents SDK sends)
        choice = None
    fields = {
        "model": body.model, "messages": [*system, *conversation], "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "user": body.user,
        "stream_options": {"include_usage": True} if body.stream else None,
        "response_format": response_format(body.text),
        "tools": None if not body.tools else [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in body.tools],
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if hasattr(choice, "name") else choice,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise APIError(400, message, param=param) from None
    return chat, conversation


RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


@contextlib.contextmanager
def responses_names() -> Iterator[None]:
    """The chat route's errors naming the Responses API's fields (``input``, not ``messages``)."""
    try:
        yield
    except APIError as error:
        if error.param in RESPONSES_NAMES:
            name = RESPONSES_NAMES[error.param]
            error.message = error.message.replace(f"{error.param}: ", f"{name}: ", 1)
            error.message = error.message.replace(" + max_tokens ", " + max_output_tokens ", 1)
            error.param = name
        raise


# ---- the answer: a Response object -------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [] if status == "in_progress" else [text_part(text)]
    return {"id": item_id or _id("msg"), "type": "message", "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _id("fc"), "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def responses_usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


class ResponsesWire:
    """One Responses request's answer: the chat answer (or its chunks) as a Response object (or
    Responses' events), the conversation stored under its id unless ``store`` is false."""

    def __init__(self, body: ResponsesRequest, conversation: list[dict[str, Any]], store: ResponseStore) -> None:
        self.body, self.conversation, self.store = body, conversation, store
        self.id = _id("resp")
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 **rest: Any) -> dict[str, Any]:
        """The Response object; ``rest`` sets ``incomplete_details`` or ``error``."""
        body = self.body
        choice = body.tool_choice
        fmt = None if body.text is None else body.text.format
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": body.model,
            "output": output, "usage": usage, "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            "top_p": DEFAULT_TOP_P if body.top_p is None else body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": choice.model_dump() if hasattr(choice, "name") else (choice or "auto"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)},
            "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user, **rest}

    def finished(self, finish_reason: str | None, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The Response object of a whole answer ("incomplete" when cut at the token limit), stored with the
        conversation and this answer (``calls`` in the chat form) unless ``store`` is false."""
        cut = finish_reason == "length"
        response = self.response("incomplete" if cut else "completed", output, usage,
                                 incomplete_details={"reason": "max_output_tokens"} if cut else None)
        if self.body.store:
            message: dict[str, Any] = {"role": "assistant", "content": content if content or calls else ""}
            if calls:
                message["tool_calls"] = calls
            self.store.put(self.id, [*self.conversation, message], response)
        return response

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response object of a whole chat answer."""
        choice = chat["choices"][0]
        content, calls = choice["message"].get("content"), choice["message"].get("tool_calls") or []
        output = [text_item(content or "")] if content or not calls else []
        output += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return self.finished(choice["finish_reason"], output, responses_usage(chat["usage"]), content, calls)

    async def stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[dict[str, str]]:
        """Responses' server-sent events of a streamed chat answer (its chunks, with usage, then ``[DONE]``)."""
        events = EventWriter(self)
        async with contextlib.aclosing(chunks):  # (closing the chat stream cancels the generation)
            for event in events.start():
                yield event
            async for chunk in chunks:
                for event in events.chunk(chunk):
                    yield event
                if events.ended:
                    return


class EventWriter:
    """The events of one streamed Response, numbered in order, from the chat chunks: each output item
    opened when its first delta comes and closed when the next item or the end comes."""

    def __init__(self, wire: ResponsesWire) -> None:
        self.wire = wire
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items so far, the last one perhaps still open
        self.open = False
        self.text = ""  # the open message's text
        self.calls: list[dict[str, Any]] = []  # the answer's calls, in the chat form
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.ended = False

    def event(self, kind: str, **data: Any) -> dict[str, str]:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(payload, separators=(",", ":"), ensure_ascii=False)}

    def start(self) -> list[dict[str, str]]:
        response = self.wire.response("in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def chunk(self, chunk: str) -> list[dict[str, str]]:
        """The events of one chat chunk (a JSON object, or ``[DONE]``)."""
        if chunk == "[DONE]":
            return self.end()
        data = json.loads(chunk)
        if "error" in data:
            return self.fail(data["error"])
        if data.get("usage"):
            self.usage = responses_usage(data["usage"])
        events = []
        for choice in data.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content"):
                events += self.add_text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self.add_call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def add_text(self, delta: str) -> list[dict[str, str]]:
        events = []
        if not (self.open and self.output[-1]["type"] == "message"):
            events = [*self.close(), *self.open_item(text_item("", "in_progress"))]
            events.append(self.event("response.content_part.added", **self._at(), content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": []}))
        self.text += delta
        if delta:
            events.append(self.event("response.output_text.delta", **self._at(), content_index=0, delta=delta,
                                     logprobs=[]))
        return events

    def add_call(self, call: dict[str, Any]) -> list[dict[str, str]]:
        events = []
        if call.get("id") is not None:
            function = call["function"]
            self.calls.append({"id": call["id"], "type": "function",
                               "function": {"name": function["name"], "arguments": ""}})
            events = [*self.close(), *self.open_item(call_item(call["id"], function["name"], "", "in_progress"))]
        delta = call.get("function", {}).get("arguments") or ""
        if delta:
            self.calls[-1]["function"]["arguments"] += delta
            events.append(self.event("response.function_call_arguments.delta", **self._at(), delta=delta))
        return events

    def open_item(self, item: dict[str, Any]) -> list[dict[str, str]]:
        self.output.append(item)
        self.open = True
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def close(self) -> list[dict[str, str]]:
        """The events that finish the open item (none when none is open)."""
        if not self.open:
            return []
        self.open = False
        item, at = self.output[-1], self._at()
        if item["type"] == "message":
            part = text_part(self.text)
            item = self.output[-1] = text_item(self.text, item_id=item["id"])
            self.text = ""
            events = [self.event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", **at, content_index=0, part=part)]
        else:
            arguments = self.calls[-1]["function"]["arguments"]
            item = self.output[-1] = call_item(item["call_id"], item["name"], arguments, item_id=item["id"])
            events = [self.event("response.function_call_arguments.done", **at, name=item["name"],
                                 arguments=arguments)]
        return [*events, self.event("response.output_item.done", output_index=at["output_index"], item=item)]

    def end(self) -> list[dict[str, str]]:
        """The last item's end and ``response.completed`` (``response.incomplete`` when cut short)."""
        events = self.close()
        if not self.output:  # an empty answer is an empty message, as whole
            events += [*self.add_text(""), *self.close()]
        content = "".join(part["text"] for item in self.output if item["type"] == "message"
                          for part in item["content"]) or None
        self.ended = True
        response = self.wire.finished(self.finish_reason, self.output, self.usage, content, self.calls)
        return [*events, self.event(f"response.{response['status']}", response=response)]

    def fail(self, error: dict[str, Any]) -> list[dict[str, str]]:
        """An ``error`` event and ``response.failed``: the generation failed (or the server stopped it)."""
        self.ended = True
        response = self.wire.response("failed", self.output, self.usage,
                                      error={"code": error.get("code") or "server_error", "message": error["message"]})
        return [self.event("error", code=error.get("code"), message=error["message"], param=error.get("param")),
                self.event("response.failed", response=response)]
