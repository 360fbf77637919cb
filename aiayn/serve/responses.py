"""From engine events to OpenAI answers, whole (``collect``) or streamed as server-sent events, and
OpenAI's error format (``APIError``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException

from aiayn.generate.constrain import GrammarConstraint
from aiayn.serve.engine import Engine
from aiayn.serve.request import Event, Request, SamplingParams
from aiayn.serve.tool_calls import ToolFormat, ToolStream, answer_message

POLL_SECONDS = 0.2  # how often a waiting handler checks for a gone client or a shutdown


class APIError(HTTPException):
    """OpenAI's error answer: {"error": {"message", "type", "param", "code"}}; an HTTPException, so
    FastAPI passes one raised while it reads the body through."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


def shutting_down(message: str = "the server is shutting down and takes no new requests") -> APIError:
    return APIError(503, message, kind="server_error", code="shutting_down")


def event_error(message: str) -> APIError:
    """The APIError for an engine error event."""
    if "shutting down" in message:
        return shutting_down(message)
    return APIError(500, message, kind="server_error", code="internal_error")


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The ``i``-th of n choices' parameters: a given seed becomes seed + i."""
    seed = params.sampling.seed
    if i == 0 or seed is None:
        return params
    return dataclasses.replace(params, sampling=dataclasses.replace(params.sampling, seed=seed + i))


class Generation:
    """The engine requests of one HTTP request, their events on this event loop: ``n`` per prompt,
    choice ``index = prompt * n + i``, each with its own copy of ``constraint``."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: SamplingParams, *, n: int = 1,
                 constraint: GrammarConstraint | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.engine = engine
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.requests: list[Request] = []
        self.prompt_tokens = sum(len(p) for p in prompts)
        try:
            for p, prompt in enumerate(prompts):
                for i in range(n):
                    own = None if constraint is None else constraint.copy()
                    request = Request(prompt, choice_params(params, i), self._sink(loop, p * n + i), own)
                    engine.submit(request)
                    self.requests.append(request)
        except BaseException:
            self.cancel()
            raise

    def _sink(self, loop: asyncio.AbstractEventLoop, index: int) -> Callable[[Event], None]:
        def deliver(event: Event) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
        return deliver

    async def next(self) -> tuple[int, Event] | None:
        """The next event, or None after ``POLL_SECONDS`` without one."""
        try:
            return await asyncio.wait_for(self.queue.get(), POLL_SECONDS)
        except TimeoutError:
            return None

    def cancel(self) -> None:
        for request in self.requests:
            if not request.finished:
                self.engine.cancel(request)


@dataclass
class Choice:
    """One prompt's answer as it accumulates: a text piece per token."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # engine TokenLogprob per token, when asked
    finish_reason: str | None = None


async def collect(generation: Generation, is_disconnected: Callable[[], Any],
                  past_grace: Callable[[], bool]) -> list[Choice]:
    """Wait for every choice's whole answer; ClientGone or APIError(503) cancel the engine requests."""
    choices = [Choice() for _ in generation.requests]
    try:
        async for index, event in _events(generation, past_grace, is_disconnected):
            if event.error is not None:
                raise event_error(event.error)
            choice = choices[index]
            choice.text.append(event.text)
            if event.logprob is not None:
                choice.logprobs.append(event.logprob)
            choice.finish_reason = event.finish_reason
    finally:
        generation.cancel()
    return choices


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[Any], offset: int = 0) -> dict[str, Any]:
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


@dataclass
class Meta:
    """What every object of one answer shares."""

    model: str
    object: str  # "chat.completion" or "text_completion"
    logprobs: bool = False
    tools: ToolFormat | None = None  # a chat answer that may call tools: its text is read into tool_calls
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, object_name: str) -> dict[str, Any]:
        prefix = "chatcmpl" if object_name.startswith("chat") else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": object_name, "created": self.created, "model": self.model}


def chat_answer(meta: Meta, generation: Generation, choices: list[Choice]) -> dict[str, Any]:
    def reply(c: Choice) -> tuple[dict[str, Any], str | None]:
        if meta.tools is not None:
            return answer_message(meta.tools, "".join(c.text), c.finish_reason)
        return {"role": "assistant", "content": "".join(c.text), "refusal": None}, c.finish_reason

    return _whole(meta, "chat.completion", generation, choices, [{
        "index": i, "message": message, "logprobs": chat_logprobs(c.logprobs) if meta.logprobs else None,
        "finish_reason": finish} for i, c in enumerate(choices) for message, finish in [reply(c)]])


def completion_answer(meta: Meta, generation: Generation, choices: list[Choice]) -> dict[str, Any]:
    return _whole(meta, "text_completion", generation, choices, [{
        "index": i, "text": "".join(c.text), "finish_reason": c.finish_reason,
        "logprobs": completion_logprobs(c.logprobs) if meta.logprobs else None} for i, c in enumerate(choices)])


def _whole(meta: Meta, name: str, generation: Generation, choices: list[Choice], items: list[Any]) -> dict[str, Any]:
    return {**meta.head(name), "choices": items,
            "usage": usage(generation.prompt_tokens, sum(len(c.text) for c in choices)), "system_fingerprint": None}


async def _events(generation: Generation, past_grace: Callable[[], bool],
                  is_disconnected: Callable[[], Any] | None = None) -> AsyncIterator[tuple[int, Event]]:
    """Every event until each choice has finished or one fails (a shutdown's end: an error event)."""
    pending = len(generation.requests)
    checked = time.monotonic()
    while pending:
        item = await generation.next()
        if item is None or time.monotonic() - checked > POLL_SECONDS:  # (tokens may never pause)
            checked = time.monotonic()
            if is_disconnected is not None and await is_disconnected():
                raise ClientGone
            if past_grace():
                cut = "the request was stopped before it finished" if is_disconnected else "the answer was cut short"
                yield 0, Event("", finish_reason="error", error=f"the server is shutting down; {cut}")
                return
        if item is None:
            continue
        yield item
        if item[1].finish_reason is not None:
            pending -= 1
            if item[1].error is not None:
                return


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def _chunk(meta: Meta, name: str, choices: list[Any], **rest: Any) -> str:
    return _json({**meta.head(name), "system_fingerprint": None, "choices": choices, **rest})


async def _stream(meta: Meta, name: str, generation: Generation, include_usage: bool,
                  past_grace: Callable[[], bool], chunks: Callable[[int, Event], list[str]],
                  first: list[str]) -> AsyncIterator[str]:
    """``first``, then ``chunks`` of each event (an error event: its error object, and no more), then
    the usage chunk and ``[DONE]``; the engine requests are cancelled at the end."""
    tokens = 0
    try:
        for chunk in first:
            yield chunk
        async for index, event in _events(generation, past_grace):
            if event.error is not None:
                yield _json(event_error(event.error).body())
                break
            tokens += 1
            for chunk in chunks(index, event):
                yield chunk
        if include_usage:
            yield _chunk(meta, name, [], usage=usage(generation.prompt_tokens, tokens))
        yield "[DONE]"
    finally:
        generation.cancel()


def chat_stream(meta: Meta, generation: Generation, include_usage: bool,
                past_grace: Callable[[], bool]) -> AsyncIterator[str]:
    """A streamed chat answer: role, content or tool-call, finish and usage chunks, then ``[DONE]``."""
    calls = [ToolStream(meta.tools) for _ in generation.requests] if meta.tools is not None else None
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, Any], logprobs: Any = None, finish: str | None = None, index: int = 0) -> str:
        return _chunk(meta, "chat.completion.chunk",
                      [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra)

    def chunks(index: int, event: Event) -> list[str]:
        out = []
        logprobs = chat_logprobs([event.logprob]) if meta.logprobs and event.logprob else None
        finish = event.finish_reason
        if calls is not None:  # the text read as content and calls (logprobs with the first delta)
            deltas = calls[index].add(event.text, final=finish is not None) or ([{}] if logprobs else [])
            out = [chunk(delta, None if k else logprobs, index=index) for k, delta in enumerate(deltas)]
            finish = calls[index].finish_reason(finish)
        elif event.text or logprobs:
            out = [chunk({"content": event.text}, logprobs, index=index)]
        return out if finish is None else [*out, chunk({}, None, finish, index=index)]

    roles = [chunk({"role": "assistant", "content": ""}, index=i) for i in range(len(generation.requests))]
    return _stream(meta, "chat.completion.chunk", generation, include_usage, past_grace, chunks, roles)


def completion_stream(meta: Meta, generation: Generation, include_usage: bool,
                      past_grace: Callable[[], bool]) -> AsyncIterator[str]:
    """Streamed completions (one ``index`` per choice), then the usage chunk and ``[DONE]``."""
    offsets = [0] * len(generation.requests)
    extra = {"usage": None} if include_usage else {}

    def chunks(index: int, event: Event) -> list[str]:
        logprobs = None
        if meta.logprobs and event.logprob is not None:
            logprobs = completion_logprobs([event.logprob], offsets[index])
            offsets[index] += len(event.logprob.token)
        if not (event.text or logprobs or event.finish_reason):
            return []
        return [_chunk(meta, "text_completion", [{"index": index, "text": event.text, "logprobs": logprobs,
                                                  "finish_reason": event.finish_reason}], **extra)]

    return _stream(meta, "text_completion", generation, include_usage, past_grace, chunks, [])
