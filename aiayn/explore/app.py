"""The explorer's FastAPI application: the page, its static files, and JSON routes over one model. Every error
is ``{"error": "one short message"}``; a body over ``MAX_BODY_BYTES`` gets 413 before it is read."""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aiayn.asgi import bounded_receive, preview
from aiayn.explore.decoding import MAX_STEPS, MAX_TOP_K, decode_steps
from aiayn.explore.models import Explorable, ExploreInputError
from aiayn.explore.positions import positions_view
from aiayn.explore.probes import ProbeCache, compute_attention, pack_matrix
from aiayn.explore.search_tree import MAX_BEAM, beam_tree
from aiayn.explore.training import run_record

MAX_TEXT_CHARS = 20_000  # refused before tokenising (every model's context is far below this)
STATIC = resources.files("aiayn.explore") / "static"


class AttentionRequest(BaseModel):
    text: str = Field(max_length=MAX_TEXT_CHARS)
    target: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)


class TokenizeRequest(BaseModel):
    text: str = Field(max_length=MAX_TEXT_CHARS)
    side: str = Field(default="source", pattern="^(source|target)$")


class GenerateRequest(BaseModel):
    text: str = Field(max_length=MAX_TEXT_CHARS)
    steps: int = Field(default=16, ge=1, le=MAX_STEPS)
    top_k: int = Field(default=5, ge=1, le=MAX_TOP_K)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    chat: bool = False


class BeamRequest(BaseModel):
    text: str = Field(max_length=MAX_TEXT_CHARS)
    beam: int = Field(default=4, ge=1, le=MAX_BEAM)
    length_penalty: float = Field(default=0.6, ge=0.0, le=3.0, allow_inf_nan=False)
    steps: int = Field(default=16, ge=1, le=MAX_STEPS)  # new tokens of a decoder-only model


# The page sends texts of at most MAX_TEXT_CHARS characters: no request of its needs 1 MiB.
MAX_BODY_BYTES = 1 << 20


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class _BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body parsing passes it on."""

    def __init__(self) -> None:
        super().__init__(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB; send less text at once")


class BodyLimit:
    """A request body over ``MAX_BODY_BYTES`` gets 413, by Content-Length or as it arrives."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            await _too_large()(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive(receive, MAX_BODY_BYTES, _BodyTooLarge), tracking_send)
        except _BodyTooLarge:
            if not started:
                await _too_large()(scope, receive, send)


def _too_large() -> JSONResponse:
    return _error(str(_BodyTooLarge().detail), 413)


def create_app(ex: Explorable) -> FastAPI:
    app = FastAPI(title="aiayn explore", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit)
    _add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(str(STATIC / "index.html"), headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    _add_api(app, ex)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(f"{where or 'request'}: {first.get('msg', 'invalid')}", 422)

    @app.exception_handler(HTTPException)
    async def framework_error(request: Request, exc: HTTPException) -> JSONResponse:
        path = preview(request.url.path, quote=False)
        message = {404: f"no route {request.method} {path}; the page is at /, its data under /api/",
                   405: f"{request.method} is not allowed on {path}"}.get(exc.status_code, preview(str(exc.detail), quote=False))
        return JSONResponse({"error": message}, status_code=exc.status_code, headers=dict(exc.headers or {}))

    @app.exception_handler(ExploreInputError)
    async def bad_input(request: Request, exc: ExploreInputError) -> JSONResponse:
        return _error(str(exc), 400)

    @app.exception_handler(Exception)
    async def failure(request: Request, exc: Exception) -> JSONResponse:  # a bug: one line, not a page
        return _error(f"internal error: {type(exc).__name__}: {exc} (please report it)", 500)


def _add_api(app: FastAPI, ex: Explorable) -> None:
    probes = ProbeCache()
    positions: dict[str, Any] = {}  # computed once, on first request

    @app.get("/api/model")
    def model_info() -> dict[str, Any]:
        return ex.summary()

    @app.post("/api/tokenize")
    def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        """The text's tokens for the page's preview; a text the model cannot take has ``error`` set."""
        what = "the target" if req.side == "target" else "the text"
        if req.side == "target" and not req.text.strip():  # no target: the model's own translation
            return {"ids": [], "labels": [], "count": 0, "limit": ex.limit, "error": None}
        try:
            ids = ex.tokens(req.text, what, target=req.side == "target") if ex.kind != "task" else []
        except ExploreInputError as exc:
            return {"ids": [], "labels": [], "count": None, "limit": ex.limit, "error": str(exc)}
        if req.side == "target" and ids:
            ids = ids[:-1]  # the target's </s> is predicted, not fed
        label = ex.label if req.side == "target" else ex.source_label
        return {"ids": ids, "labels": [label(i) for i in ids], "count": len(ids), "limit": ex.limit,
                "error": None}

    @app.post("/api/attention")
    def attention(req: AttentionRequest) -> dict[str, Any]:
        with ex.lock:
            probe = compute_attention(ex, req.text, req.target)
        probes.put(probe)
        return probe.describe()

    @app.get("/api/attention/{key}/{stack}/{layer}")
    def attention_layer(key: str, stack: str, layer: int) -> Any:
        probe = probes.get(key)
        if probe is None:
            return _error("this text's attention is no longer kept; show it again", 404)
        try:
            weights = probe.layer(stack, layer)
        except KeyError:
            return _error(f"no attention stack {stack!r}; this text has {', '.join(probe.stacks)}", 404)
        except IndexError as exc:
            return _error(str(exc), 404)
        return {"stack": stack, "layer": layer, "weights": pack_matrix(weights)}

    @app.post("/api/generate")
    def generate(req: GenerateRequest) -> dict[str, Any]:
        return decode_steps(ex, req.text, steps=req.steps, top_k=req.top_k, temperature=req.temperature,
                            seed=req.seed, chat=req.chat)

    @app.post("/api/beam")
    def beam(req: BeamRequest) -> dict[str, Any]:
        return beam_tree(ex, req.text, beam=req.beam, length_penalty=req.length_penalty, steps=req.steps)

    @app.get("/api/positions")
    def positional() -> dict[str, Any]:
        if not positions:
            with ex.lock:
                positions.update(positions_view(ex))
        return positions

    @app.get("/api/run")
    def run() -> dict[str, Any]:
        return run_record(ex.run_dir)
