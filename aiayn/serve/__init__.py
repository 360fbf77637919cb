"""``aiayn serve``: an OpenAI-compatible HTTP server over a continuous-batching engine (``engine``;
routes in ``app``; docs/serve.md)."""

from aiayn.serve.engine import Engine, Event, Request, SamplingParams, slot_plan
from aiayn.serve.models import ServedModel, load_served_model
from aiayn.serve.server import build_state, parse_size, server

__all__ = ["Engine", "Event", "Request", "SamplingParams", "ServedModel", "build_state", "load_served_model",
           "parse_size", "server", "slot_plan"]
