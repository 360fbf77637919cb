"""``aiayn serve``: an OpenAI-compatible HTTP server with continuous batching.

* ``engine``: continuous batching, each step ``scheduler`` (rows, admission, preemption, the
  prefill chunk: host numbers only) -> ``runner`` (the model, the KV cache and the forwards) ->
  ``sampler`` (each row's next token: bias, penalties, grammar masks, the draw) -> ``output``
  (text, stop strings, events); ``request`` its data types; ``blocks`` the paged KV cache's plan
  and bookkeeping (a pool of blocks from the memory budget, admission by free blocks, the prefix
  cache, preemption), or fixed slots (``--kv-layout slots``);
* ``tools`` / ``tool_calls``: OpenAI tool calls (the prompt with tools, the constraining grammar,
  the answer read back);
* ``app``: the FastAPI routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
  ``/v1/models``, ``/health``, ``/metrics``), ``schemas`` their strict request models,
  ``responses`` the OpenAI wire format (whole and streamed);
* ``embedding``: a decoder's sentence vectors, a forward at a time (the engine runs them between
  its decode steps); ``limits``: how much one request may ask (400 past it);
* ``models``: what is served (a decoder-only text model, or a sentence encoder);
* ``server``: putting it together under uvicorn; ``metrics``: Prometheus.

See docs/serve.md.
"""

from aiayn.serve.engine import Engine, Event, Request, SamplingParams, slot_plan
from aiayn.serve.models import ServedModel, load_served_model
from aiayn.serve.server import build_state, parse_size, server

__all__ = ["Engine", "Event", "Request", "SamplingParams", "ServedModel", "build_state", "load_served_model",
           "parse_size", "server", "slot_plan"]
