"""The OpenAI-compatible HTTP API of ``aiayn serve``: FastAPI routes over the engine. Every error is
OpenAI's ``{"error": {...}}``, never a traceback (400, 401, 404, 413, 429 with ``Retry-After``, 503)."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aiayn.asgi import bounded_receive, preview
from aiayn.generate.constrain import BOUNDS, GrammarConstraint, JsonBounds
from aiayn.generate.sampling import SamplingConfig
from aiayn.interop.mapping import InteropError
from aiayn.serve.engine import Engine, EngineFailed, QueueFull, SamplingParams, ShuttingDown
from aiayn.serve.limits import Limits, check_tokens, prompt_ids, token_ids, too_long
from aiayn.serve.metrics import Metrics
from aiayn.serve.models import ServedModel, encoder_token_counts, vector_size
from aiayn.serve.responses import (
    POLL_SECONDS,
    APIError,
    ClientGone,
    Generation,
    Meta,
    chat_answer,
    chat_stream,
    collect,
    completion_answer,
    completion_stream,
    shutting_down,
)
from aiayn.serve.responses_api import ResponseStore, ResponsesWire, chat_request, responses_names
from aiayn.serve.schemas import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
    validation_message,
)
from aiayn.serve.tool_calls import ToolFormat, tool_format
from aiayn.serve.tools import ToolSettings, render_chat, tool_settings
from aiayn.textgen import TextModel

logger = logging.getLogger("aiayn.serve")


@dataclass
class ServerState:
    """What the routes share: the model, its engine (decoder-only models), the settings."""

    served: ServedModel
    engine: Engine | None
    metrics: Metrics
    api_key: str | None = None
    shutdown_grace: float = 30.0  # seconds running requests get to finish after SIGTERM
    draining_since: float | None = None  # set when a shutdown begins
    created: int = field(default_factory=lambda: int(time.time()))
    encoder_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    limits: Limits = field(default_factory=Limits)
    bounds: JsonBounds = BOUNDS  # the caps on what a response_format or tool schema leaves open
    responses: ResponseStore = field(default_factory=ResponseStore)  # kept for previous_response_id

    def begin_drain(self) -> None:
        if self.draining_since is None:
            self.draining_since = time.monotonic()

    def past_grace(self) -> bool:
        return self.draining_since is not None and time.monotonic() - self.draining_since > self.shutdown_grace

    def check_model(self, name: str) -> None:
        if name != self.served.name:
            raise APIError(404, f"the model {preview(name)} does not exist; this server serves "
                                f"{self.served.name!r} (GET /v1/models)", code="model_not_found", param="model")

    def generator(self, name: str) -> tuple[TextModel, Engine]:
        self.check_model(name)
        if self.served.lm is None or self.engine is None:
            raise APIError(400, f"{self.served.name} is an encoder (sentence embeddings); it serves /v1/embeddings "
                                f"only", code="model_not_supported", param="model")
        return self.served.lm, self.engine


# ---- the plumbing: auth, shutdown, metrics per route, errors ------------------------------------
MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused (413) before it is read


def _route_label(path: str) -> str:
    """The route a request path is counted under in /metrics (ids collapsed to ``{id}``)."""
    if path in ROUTES:
        return path
    for route in ("/v1/models/", "/v1/responses/"):
        if path.startswith(route):
            return route + "{id}"
    return "other"


class ServerMiddleware:
    """Pure ASGI (streams pass through untouched): the API key on /v1 and /metrics, 503 once a shutdown
    began, 413 for bodies over ``MAX_BODY_BYTES``, and each answer's status counted per route."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        route = _route_label(path)
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._refusal(scope, path)
            if error is not None:
                await _error_response(error)(scope, receive, counting_send)
            else:
                await self.app(scope, bounded_receive(receive, MAX_BODY_BYTES, _too_large), counting_send)
        finally:
            self.state.metrics.requests.labels(route=route, status=str(status["code"])).inc()

    def _refusal(self, scope: Scope, path: str) -> APIError | None:
        headers = dict(scope["headers"])
        protected = path.startswith("/v1/") or path == "/metrics"
        if protected and self.state.api_key is not None:
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.state.api_key.encode()):
                what = "no API key was given" if not given else "the API key is not valid"
                return APIError(401, f"{what}; send the header 'Authorization: Bearer <key>' with the server's "
                                     f"--api-key", code="invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _too_large()
        if path.startswith("/v1/") and self.state.draining_since is not None:
            return shutting_down()
        return None


def _too_large() -> APIError:
    return APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB; send less text at once",
                    code="request_too_large")


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {preview(request.url.path, quote=False)}; see {', '.join(ROUTES)}",
                   405: f"{request.method} is not allowed on {preview(request.url.path, quote=False)}"
                   }.get(exc.status_code, str(exc.detail))
        return _error_response(APIError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}; the server log has the details",
                                        kind="server_error", code="internal_error"))


# ---- turning a request into engine work -------------------------------------------------------
def chat_message(message: Any) -> dict[str, Any]:
    """A request message as the chat template reads it ("developer" becomes "system")."""
    data = message.model_dump(exclude_none=True, exclude={"refusal"})
    if data["role"] == "developer":
        data["role"] = "system"
    return data


def sampling_params(body: Any, engine: Engine, prompts: list[list[int]], limit: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The engine's parameters; 400 unless prompt + answer fit the context and logit_bias names ids of the vocabulary."""
    longest = max(len(p) for p in prompts)
    room = engine.context - longest
    if room < 1 or (limit is not None and limit > room):
        asked = f" + max_tokens {limit} = {longest + limit}" if limit is not None else ""
        raise APIError(400, f"this server's context is {engine.context} tokens (prompt + answer), but the prompt is "
                            f"{longest} tokens{asked}; shorten the prompt or ask for fewer tokens",
                       code="context_length_exceeded", param="messages" if hasattr(body, "messages") else "prompt")
    vocab = engine.model.config.vocab_size
    bias = tuple((int(key), value) for key, value in (body.logit_bias or {}).items())
    outside = [key for key, _ in bias if key >= vocab]
    if outside:
        raise APIError(400, f"logit_bias: token id {outside[0]} is outside the model's vocabulary of {vocab} "
                            f"(ids 0 to {vocab - 1})", param="logit_bias")
    sampling = SamplingConfig(temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                              top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p, top_k=body.top_k,
                              repetition_penalty=body.repetition_penalty or 1.0, seed=body.seed)
    return SamplingParams(max_tokens=limit if limit is not None else room, sampling=sampling,
                          stop=tuple(body.stop or ()), logprobs=logprobs, logit_bias=bias,
                          presence_penalty=body.presence_penalty or 0.0,
                          frequency_penalty=body.frequency_penalty or 0.0)


def response_constraint(lm: TextModel, body: Any, bounds: JsonBounds) -> GrammarConstraint | None:
    """The compiled grammar of ``body.response_format`` (None: free text) within ``bounds``, off the
    event loop; 400 for an invalid schema or a model that cannot follow one."""
    response_format = body.response_format and body.response_format.model_dump(by_alias=True)
    try:
        return GrammarConstraint.from_response_format(lm.tokenizer, response_format, eos_id=lm.eos_id, bounds=bounds)
    except ValueError as exc:
        raise APIError(400, f"response_format: {exc}", param="response_format") from None


def check_prompt_count(engine: Engine, limits: Limits, n: int, choices: int = 1) -> None:
    """400 for more prompts than one request takes, or more answers than the server ever holds at once."""
    limits.check_count(n, "prompt")
    most = engine.max_queue + engine.max_batch
    if n * choices > most:
        what = f"{n} prompts" if choices == 1 else f"{n} prompt{'s' if n > 1 else ''} x n={choices} answers"
        raise APIError(400, f"{what} in one request, but this server holds at most {most} "
                            f"requests at once ({engine.max_batch} decoding + {engine.max_queue} waiting: "
                            f"--max-batch, --max-queue); send at most {most} {'prompts' if choices == 1 else 'answers'} "
                            f"per request", param="prompt" if choices == 1 else "n", code="too_many_prompts")


def busy(exc: QueueFull, waiting: str) -> APIError:
    return APIError(429, f"the server is busy ({waiting} waiting); retry after {exc.retry_after} s",
                    kind="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after)})


async def generate(state: ServerState, request: Request, lm: TextModel, engine: Engine, body: Any,
                   prompts: list[list[int]], limit: int | None, logprobs: int | None, meta: Meta,
                   tools: ToolSettings | None = None, wire: ResponsesWire | None = None) -> Any:
    """The request's generation, answered whole or streamed (server-sent events); ``wire``: a chat
    answer written in the Responses API's format."""
    params = sampling_params(body, engine, prompts, limit, logprobs)
    constraint = await asyncio.to_thread(response_constraint, lm, body, state.bounds)
    if tools is not None:  # (a response_format is then the text answer's, checked just above)
        meta.tools, constraint = await asyncio.to_thread(tool_constraint, lm, tools, body.response_format, state.bounds)
    try:
        generation = Generation(engine, prompts, params, n=body.n, constraint=constraint)
    except QueueFull as exc:
        raise busy(exc, f"{engine.max_queue} requests") from None
    except ShuttingDown:
        raise shutting_down() from None
    chat = meta.object == "chat.completion"
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = (chat_stream if chat else completion_stream)(meta, generation, include_usage, state.past_grace)
        return EventSourceResponse(events if wire is None else wire.stream(events),
                                   shutdown_grace_period=state.shutdown_grace + 1.0)
    try:
        choices = await collect(generation, request.is_disconnected, state.past_grace)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    answer = (chat_answer if chat else completion_answer)(meta, generation, choices)
    return answer if wire is None else wire.answer(answer)


# ---- the app -----------------------------------------------------------------------------------
ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/health",
          "/metrics")


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.engine is not None:
            state.engine.start()
        try:
            yield
        finally:
            if state.engine is not None:
                state.engine.stop()

    app = FastAPI(title="aiayn serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ServerMiddleware, state=state)
    install_error_handlers(app)
    add_status_routes(app, state)
    add_generation_routes(app, state)
    return app


def add_status_routes(app: FastAPI, state: ServerState) -> None:
    """``/health``, ``/metrics`` and ``/v1/models``."""

    @app.get("/health")
    async def health() -> JSONResponse:
        draining = state.draining_since is not None
        engine = state.engine
        body = {"status": "shutting_down" if draining else "ok", "model": state.served.name,
                "running": engine.running if engine else 0, "waiting": len(engine.waiting) if engine else 0}
        return JSONResponse(body, status_code=503 if draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    def model_card() -> dict[str, Any]:
        return {"id": state.served.name, "object": "model", "created": state.created, "owned_by": "aiayn"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card()


def add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/chat/completions``, ``/v1/responses`` (a chat request in another wire format),
    ``/v1/completions`` and ``/v1/embeddings``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await chat_generation(state, request, body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        chat, conversation = chat_request(body, state.responses)
        with responses_names():
            return await chat_generation(state, request, chat, ResponsesWire(body, conversation, state.responses))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Any:
        return state.responses.response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Any:
        return state.responses.delete(response_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        lm, engine = state.generator(body.model)
        check_prompt_count(engine, state.limits, len(body.prompt), body.n)
        per_prompt = state.limits.input_tokens if state.limits.input_tokens < engine.context else None
        prompts = await asyncio.to_thread(token_ids, lm, body.prompt, "prompt", state.limits, per_prompt)
        meta = Meta(state.served.name, "text_completion", logprobs=body.logprobs is not None)
        return await generate(state, request, lm, engine, body, prompts, body.max_tokens, body.logprobs, meta)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        state.check_model(body.model)
        size = vector_size(state.served)
        if body.dimensions is not None and body.dimensions != size:
            raise APIError(400, f"dimensions: this model's vectors have {size} dimensions; leave it out or give {size}",
                           param="dimensions")
        state.limits.check_count(len(body.input), "input")
        try:
            vectors, tokens = await embed(state, body.input, request.is_disconnected)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        content = await asyncio.to_thread(embeddings_json, vectors, body.encoding_format, state.served.name, tokens)
        return Response(content, media_type="application/json")


async def chat_generation(state: ServerState, request: Request, body: ChatCompletionRequest,
                          wire: ResponsesWire | None = None) -> Any:
    """A chat request's answer (``wire``: written in the Responses API's format)."""
    lm, engine = state.generator(body.model)
    if lm.chat_template is None:
        raise APIError(400, f"{state.served.name} has no chat template; use /v1/completions with a plain prompt",
                       param="messages")
    check_prompt_count(engine, state.limits, 1, body.n)
    tools = tool_settings(body.tools, body.tool_choice, body.parallel_tool_calls)  # (checked by the schema)
    messages = [chat_message(m) for m in body.messages]
    prompts = [await asyncio.to_thread(chat_ids, state, lm, engine, messages, tools)]
    top = (body.top_logprobs or 0) if body.logprobs else None
    meta = Meta(state.served.name, "chat.completion", logprobs=body.logprobs)
    return await generate(state, request, lm, engine, body, prompts, body.token_limit, top, meta, tools, wire)


def tool_constraint(lm: TextModel, tools: ToolSettings, response_format: Any,
                    bounds: JsonBounds) -> tuple[ToolFormat, GrammarConstraint]:
    """The tool-call format and grammar of a chat request, within ``bounds``; 400 for a schema the model cannot follow."""
    kind = None if response_format is None else response_format.type
    schema = None  # free text
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        schema = response_format.json_schema.schema_ or {}  # (none given: any JSON value)
    try:
        return tool_format(lm, tools, schema, bounds)
    except ValueError as exc:
        raise APIError(400, f"tools: {exc}", param="tools") from None


def chat_ids(state: ServerState, lm: TextModel, engine: Engine, messages: list[dict[str, Any]],
             tools: ToolSettings | None = None) -> list[int]:
    """The token ids of the chat prompt for ``messages`` and ``tools``; 400 if the template refuses
    them or the prompt is over the per-input limit."""
    assert lm.chat_template is not None
    try:
        text = render_chat(lm.chat_template, messages, tools)
    except InteropError as exc:  # the template refused the messages (e.g. an unknown role order)
        raise APIError(400, f"messages: {exc}", param="messages") from None
    ids = prompt_ids(lm, text, "messages")
    if state.limits.input_tokens < engine.context and len(ids) > state.limits.input_tokens:
        raise too_long("messages", len(ids), state.limits.input_tokens, "chat prompt")
    return ids


def embeddings_json(vectors: torch.Tensor, encoding: str, model: str, tokens: int) -> bytes:
    """The answer's JSON, a vector at a time (on a worker thread, not to hold the event loop)."""
    def item(i: int, v: torch.Tensor) -> str:
        vector = (base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii") if encoding == "base64"
                  else v.tolist())
        return json.dumps({"object": "embedding", "index": i, "embedding": vector})

    data = ",".join(item(i, v) for i, v in enumerate(vectors))
    usage = json.dumps({"prompt_tokens": tokens, "total_tokens": tokens})
    return f'{{"object":"list","data":[{data}],"model":{json.dumps(model)},"usage":{usage}}}'.encode()


ENCODER_BATCH = 32  # texts an encoder reads per forward (SentenceEncoder.encode's default)


async def embed(state: ServerState, inputs: list[str | list[int]],
                is_disconnected: Callable[[], Awaitable[bool]]) -> tuple[torch.Tensor, int]:
    """(n, d) vectors of the inputs and the tokens read: an encoder on a worker thread, a batch at a
    time; a decoder on the engine thread. ClientGone if the client leaves meanwhile."""
    served, limits = state.served, state.limits
    if served.encoder is not None:
        encoder = served.encoder
        if any(not isinstance(text, str) or not text.strip() for text in inputs):
            raise APIError(400, "input: this encoder embeds text; give non-empty strings (not token ids)",
                           param="input")
        texts: list[str] = [t for t in inputs if isinstance(t, str)]
        counts = await asyncio.to_thread(encoder_token_counts, encoder, texts)
        check_tokens(counts, "input", limits)
        batches = []
        for start in range(0, len(texts), ENCODER_BATCH):  # encode()'s own batches: the same vectors
            if await is_disconnected():
                raise ClientGone
            async with state.encoder_lock:
                batches.append(await asyncio.to_thread(encoder.encode, texts[start: start + ENCODER_BATCH],
                                                       batch_size=ENCODER_BATCH))
        return torch.cat(batches), sum(counts)
    lm, engine = state.served.lm, state.engine
    assert lm is not None and engine is not None
    prompts = await asyncio.to_thread(token_ids, lm, inputs, "input", limits, limits.input_tokens)
    try:
        job = engine.embed(prompts)
    except QueueFull as exc:
        raise busy(exc, f"{len(engine.embeddings)} embedding requests") from None
    except ShuttingDown:
        raise shutting_down("the server is shutting down") from None
    waiting = asyncio.wrap_future(job.future)
    try:
        while not waiting.done():
            await asyncio.wait([waiting], timeout=POLL_SECONDS)
            if not waiting.done() and await is_disconnected():
                raise ClientGone
            if not waiting.done() and state.past_grace():
                raise shutting_down("the server is shutting down; the request was stopped before it finished")
        return waiting.result(), job.tokens
    except ShuttingDown:
        raise shutting_down("the server is shutting down") from None
    except EngineFailed as exc:
        raise APIError(500, str(exc), kind="server_error", code="internal_error") from None
    finally:
        engine.embeddings.cancel(job)  # (done: nothing to drop)
