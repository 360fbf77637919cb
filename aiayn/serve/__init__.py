"""``aiayn serve``: an OpenAI-compatible HTTP server over a continuous-batching engine.

The engine (``engine``) composes ``scheduler``, ``runner``, ``sampler`` and ``output`` over the
types of ``request``; ``app`` has the routes. docs/architecture.md lists every module, docs/serve.md
explains them.
"""

from aiayn.serve.engine import Engine, Event, Request, SamplingParams, slot_plan
from aiayn.serve.models import ServedModel, load_served_model
from aiayn.serve.server import build_state, parse_size, server

__all__ = ["Engine", "Event", "Request", "SamplingParams", "ServedModel", "build_state", "load_served_model",
           "parse_size", "server", "slot_plan"]
