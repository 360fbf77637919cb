"""Putting a server together: the model, its engine and slots, the app, uvicorn (``aiayn serve``)."""

from __future__ import annotations

import re
import socket
from types import FrameType

import torch
import uvicorn

from aiayn.device import model_device
from aiayn.generate.constrain import BOUNDS, JsonBounds
from aiayn.models.base import count_parameters
from aiayn.nn.kv_memory import format_bytes
from aiayn.serve.app import ServerState, create_app
from aiayn.serve.blocks import DEFAULT_BLOCK_SIZE, BlockPlan, block_plan
from aiayn.serve.compiled_step import bucket_sizes
from aiayn.serve.embedding import DEFAULT_CHUNK
from aiayn.serve.engine import Engine, slot_plan
from aiayn.serve.limits import MAX_INPUT_TOKENS, MAX_INPUTS, MAX_REQUEST_TOKENS, Limits
from aiayn.serve.metrics import Metrics
from aiayn.serve.models import ServedModel

DEFAULT_CONTEXT = 2048  # tokens per slot when the model allows more (SmolLM2: 8192)
# Seconds an idle keep-alive connection stays open (--keep-alive): longer than common clients' pools
# keep one (httpx 5 s, aiohttp 15 s), so a client never sends on a connection the server is closing.
KEEP_ALIVE_SECONDS = 20.0
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'2GiB', '512 MiB', '1.5G', '1000000' -> bytes (binary units). ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match[2].lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write it like 2GiB, 512MiB or a number of bytes")
    size = int(float(match[1]) * _UNITS[match[2].lower()])
    if size <= 0:
        raise ValueError(f"{text!r}: the size must be positive")
    return size


def weights_summary(model: torch.nn.Module) -> str:
    """'134,515,008 parameters, float32'. Lowered layers (``--quantize``) hold their weights as
    buffers: counted too (a tied table once) and their types named."""
    from aiayn.fast.q4 import BlockEmbedding, BlockLinear  # lazily: the kernel's module
    from aiayn.fast.quantize import Int8Linear

    lowered, kinds, seen = 0, set(), set()
    for module in model.modules():
        if isinstance(module, Int8Linear):
            values, kind, n_weights = module.weight_int8, "int8", module.weight_int8.numel()  # (o, i) int8
        elif isinstance(module, BlockLinear | BlockEmbedding):
            values, kind, n_weights = module.q, module.kind, module.spec[3] * module.spec[4]  # n x k
        else:
            continue
        kinds.add(kind)
        if values.data_ptr() not in seen:  # a tied output layer shares the table's blocks
            seen.add(values.data_ptr())
            lowered += n_weights
        if getattr(module, "bias", None) is not None:  # a buffer there too
            lowered += module.bias.numel()
    dtype = str(getattr(model, "float_dtype", torch.float32)).removeprefix("torch.")
    total = count_parameters(model) + lowered
    if not kinds:
        return f"{total:,} parameters, {dtype}"
    return f"{total:,} parameters ({lowered:,} in {', '.join(sorted(kinds))} weights), {dtype} activations"


def build_state(served: ServedModel, *, max_batch: int = 16, context: int | None = None,
                kv_budget: int = 2 << 30, kv_cache: str | None = None, prefill_chunk: int = 512,
                max_queue: int = 64, api_key: str | None = None, shutdown_grace: float = 30.0,
                threads: int | None = None, max_inputs: int = MAX_INPUTS, max_input_tokens: int | None = None,
                max_request_tokens: int = MAX_REQUEST_TOKENS, embed_chunk: int = DEFAULT_CHUNK,
                embed_share: float = 0.5, kv_layout: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                prefix_caching: bool = True, compile: bool = False,
                json_bounds: JsonBounds = BOUNDS) -> tuple[ServerState, list[str]]:
    """The server's state and its start-up lines; ValueError for settings that cannot work.
    ``max_input_tokens`` None: 8,192 or the model's context if smaller; ``kv_layout`` None: paged,
    but slots for a quantised ``kv_cache`` or with ``compile``."""
    metrics = Metrics()
    engine = None
    model_context = served.lm.context if served.lm is not None else served.encoder.max_length  # type: ignore[union-attr]
    if max_input_tokens is not None and max_input_tokens > model_context and served.lm is not None:
        raise ValueError(f"--max-input-tokens {max_input_tokens} is more than the model's context of "
                         f"{model_context} tokens; give at most that")
    limits = Limits(max_inputs, max_input_tokens or min(MAX_INPUT_TOKENS, model_context), max_request_tokens)
    why = "the model's context" if max_input_tokens is None and model_context < MAX_INPUT_TOKENS else ""
    if served.lm is not None:
        lm = served.lm
        context = context or min(lm.context, DEFAULT_CONTEXT)
        if kv_layout not in (None, "paged", "slots"):
            raise ValueError(f"--kv-layout must be paged or slots, got {kv_layout!r}")
        if kv_layout == "paged" or (kv_layout is None and kv_cache is None and not compile):
            plan = block_plan(lm, max_batch=max_batch, context=context, budget=kv_budget, kv_cache=kv_cache,
                              block_size=block_size, prefix_caching=prefix_caching)
        else:
            plan = slot_plan(lm, max_batch=max_batch, context=context, budget=kv_budget, kv_cache=kv_cache)
        if isinstance(plan, BlockPlan) and any(getattr(m, "cache_kernel", None) is not None for m in lm.model.modules()):
            from aiayn.fast.paged_attention_build import kernel_ops

            kernel_ops()  # the paged-attention kernel built or loaded now, not at a request
        engine = Engine(lm, plan, kv_cache=kv_cache, prefill_chunk=prefill_chunk, max_queue=max_queue,
                        metrics=metrics, threads=threads, embed_chunk=embed_chunk, embed_share=embed_share,
                        compile=compile)
        lines = [f"model {served.name}: decoder-only, {weights_summary(lm.model)}, on {model_device(lm.model)}, "
                 f"context {lm.context} tokens"
                 f"{', chat template' if lm.chat_template is not None else ', no chat template'}",
                 plan.describe(kv_budget),
                 f"prefill in chunks of {prefill_chunk} tokens; at most {max_queue} requests wait for a slot "
                 f"(then 429)",
                 f"{limits.describe(why)}; embeddings in forwards of {embed_chunk} tokens, at most "
                 f"{embed_share:.0%} of the engine's time while streams run"]
        if compile:
            lines.append(f"decode steps compiled, a graph per batch size of {', '.join(map(str, bucket_sizes(plan.rows)))} "
                         f"rows (each compiles the first time the running requests reach it)")
        if plan.rows < max_batch:
            lines.append(f"  (--max-batch {max_batch} asked for more: the budget of {format_bytes(kv_budget)} "
                         f"holds {plan.rows})")
        if isinstance(plan, BlockPlan) and plan.capacity_tokens < context:
            lines.append(f"  (a request may hold at most {plan.capacity_tokens} tokens: the budget of "
                         f"{format_bytes(kv_budget)} holds less than --context {context})")
    else:
        assert served.encoder is not None
        decoding = [option for option, given in (("--compile", compile), ("--kv-layout", kv_layout is not None),
                                                  ("--kv-cache", kv_cache is not None)) if given]
        if decoding:  # refused rather than silently ignored
            raise ValueError(f"{' and '.join(decoding)} {'sets' if len(decoding) == 1 else 'set'} how a decoder "
                             f"generates tokens; {served.name} is a sentence encoder (embeddings only): leave "
                             f"{'it' if len(decoding) == 1 else 'them'} out")
        lines = [f"model {served.name}: sentence encoder ({served.encoder.pooling} pooling), "
                 f"{count_parameters(served.encoder.model):,} parameters, on {model_device(served.encoder.model)}; "
                 f"serves /v1/embeddings", limits.describe(why)]
    state = ServerState(served, engine, metrics, api_key=api_key, shutdown_grace=shutdown_grace, limits=limits,
                        bounds=json_bounds)
    return state, lines


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A line to print when the server listens beyond this machine without an API key."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if loopback or api_key:
        return None
    return (f"warning: listening on {host} without --api-key: anyone who reaches this address can use the "
            f"model; give --api-key or --host 127.0.0.1")


def check_port(host: str, port: int, *, advice: str = "choose another --port or --host",
               error: type[OSError] = OSError) -> None:
    """``error`` with a clear message, ending in ``advice``, if ``host:port`` cannot be bound (in use, no
    such address); the explorer's check too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise error(f"cannot listen on {host}:{port} ({exc.strerror or exc}); {advice}") from None


class GracefulServer(uvicorn.Server):
    """uvicorn, telling the app when a shutdown (SIGTERM, Ctrl-C) begins (``ServerState.begin_drain``)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.begin_drain()
        super().handle_exit(sig, frame)


def server(state: ServerState, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
           keep_alive: float = KEEP_ALIVE_SECONDS) -> GracefulServer:
    """A uvicorn server for ``state`` (``run()`` it, or ``serve()`` it on an event loop)."""
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_keep_alive=keep_alive,
                            timeout_graceful_shutdown=int(state.shutdown_grace) + 3, access_log=False)
    return GracefulServer(config, state)
