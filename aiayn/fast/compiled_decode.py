"""A decode step compiled by ``torch.compile`` into one graph: the eager decoder-only step costs a
small model most of its time in dispatching a few hundred small ops from Python.

The step runs the same stack as the eager model (``TransformerStack``) in one of two layouts:

* **the filled prefix** (the CPU): every shape fixed by the cache but the filled prefix's length,
  marked dynamic, and linear layers on a few rows the ways measured fastest compiled
  (``aiayn.fast.matvec``), the weights frozen into the graph;
* **the whole buffer** (CUDA): attention over all of the cache's slots under its validity mask, so
  every shape is static and the graph replays as a CUDA graph (``mode="reduce-overhead"``, the
  cache's buffers marked static: gpt-fast's and Hugging Face's StaticCache's recipe), with no host
  sync in the step. Unfilled slots are masked keys, so the result is the prefix layout's.

``aiayn.generate.decode_step(..., compile=True)`` calls it.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from aiayn.fast.matvec import MatvecLinears
from aiayn.models.blocks import StackInputs, check_tokens
from aiayn.models.decoder_only import DecoderOnly
from aiayn.nn import data_checks
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.masks import key_mask


def _static_step(model: DecoderOnly, tokens: Tensor, positions: Tensor, slot: Tensor, key_valid: Tensor,
                 key_positions: Tensor, cache: KVCache) -> Tensor:
    """tokens, positions (b, 1) long, ``slot`` (1,) long (the cache slot the new token fills),
    ``key_valid`` (b, n) bool and ``key_positions`` (b, n) long (the cache's first n = slot + 1
    slots, n symbolic, or all of its slots, n = max_len; the new one's already set) -> next-token
    logits (b, v): the graph torch.compile traces.

    The decoder's own ``TransformerStack.run`` on inputs built here without reading a tensor into
    Python: attention covers the n filled slots (the key mask's width), the new keys go to
    ``slot``. Linear layers on a few rows run the ways measured fastest compiled
    (``MatvecLinears``): at batch 1 a fused multiply + sum that reads the weights about twice as
    fast as the matmul."""
    stack = model.decoder
    self_attn = stack.attention_inputs(positions, key_positions, key_mask(key_valid), cache_pos=slot)
    valid = torch.ones_like(tokens, dtype=torch.bool)  # (b, 1): every new token is real
    inputs = StackInputs(positions=positions, valid=valid, self_attn=self_attn)
    with MatvecLinears():
        hidden = stack.run(tokens, inputs, cache=cache).hidden  # (b, 1, d)
        return model.lm_head(hidden[:, -1])


# One compiled step per model, its graphs kept apart from other models' (``isolate_recompiles``)
# and dropped with the model (a weak key), instead of one step for all told apart by Dynamo's
# guards on every submodule: those are ~6,000 checks per call (~0.6 ms of SmolLM2's ~6 ms step,
# measured), so the graphs are guarded on the step's inputs only (``_inputs_only``).
_compiled_steps: weakref.WeakKeyDictionary[nn.Module, dict[bool, Callable[..., Tensor]]] = weakref.WeakKeyDictionary()
# The devices whose compiled step attends over the whole cache buffer (static shapes, CUDA graphs);
# elsewhere over the filled prefix (tests put "cpu" here to check the CUDA layout on a CPU).
WHOLE_BUFFER_DEVICES: tuple[str, ...] = ("cuda",)


def forget_compiled(model: nn.Module) -> None:
    """Drop ``model``'s compiled decode graphs, so that its next compiled step compiles afresh: call
    it after changing the model in place by hand (its weights, dtype or layers). aiayn's converters
    (``optimize``, ``plain``, ``lower_precision``) call it themselves."""
    _compiled_steps.pop(model, None)


COMPILED_CACHE_MULTIPLE = 64  # compiled decoding rounds its cache up to this, so lengths share graphs


def cache_len(n: int, compile: bool) -> int:
    """Slots a decoder allocates for n tokens: n, or (compiled) n rounded up to a multiple of 64,
    so that requests of similar length reuse one compiled graph instead of compiling again (the
    graph attends over the filled slots only; the buffer size is part of its shapes)."""
    return -(-n // COMPILED_CACHE_MULTIPLE) * COMPILED_CACHE_MULTIPLE if compile else n


def compiled_decode_step(model: DecoderOnly, tokens: Tensor, cache: KVCache) -> Tensor:
    """One decode step, tokens (b, 1) -> logits (b, v), through a ``torch.compile``d graph.

    The eager step spends most of a small model's time dispatching a few hundred small ops from
    Python; this one runs the decoder's ``TransformerStack.run`` (the same blocks; every shape
    fixed by the cache but the filled prefix's length, marked dynamic) compiled per model and
    shape (Inductor: C++ kernels for the element-wise work; projections on a few rows as fused
    multiply + sum loops, ``aiayn.fast.matvec``; larger batches through the matmul library with
    pre-packed weights). The first call compiles (seconds to a minute; another batch size or cache
    size compiles again: decoders round the cache up to a multiple of 64 slots to share graphs);
    the result equals the eager step up to float rounding
    (tests/consistency/test_compiled_decode.py). What ``forward`` checks is checked here, in Python.

    The graph holds the weights as constants (Inductor "freezing"; it keeps its own pre-packed
    copy of them) and is not guarded on the model's submodules: after changing a model in place
    (weights, dtype, layers) by hand, call ``forget_compiled(model)`` before decoding it compiled
    again (aiayn's converters do).
    """
    if cache.quantize is not None:
        raise ValueError("compiled decoding needs a float KV cache; drop compile or the cache quantisation")
    if model.training:
        raise ValueError("compiled decoding runs the eval-mode model; call model.eval() first")
    check_tokens("tokens", tokens, model.config.vocab_size)
    if tokens.shape != (cache.batch_size, 1):
        raise ValueError(f"a compiled decode step takes one token per row, shape ({cache.batch_size}, 1), "
                         f"got {tuple(tokens.shape)}")
    if cache.length >= cache.max_len:
        raise ValueError(f"KV cache is full: {cache.length} slot(s) used of max_len={cache.max_len}; "
                         f"create the cache with a larger max_len")
    positions = cache.next_positions()[:, None]  # (b, 1): real tokens so far
    if data_checks.reads_data(positions):
        top = int(positions.max())
        if top >= model.config.max_seq_len:
            raise ValueError(f"sequence too long: position {top} needs max_seq_len > {top}, but the model has "
                             f"max_seq_len={model.config.max_seq_len}; ask for fewer tokens")
    else:  # checked by the device, without waiting for it (the decode loops check lengths up front)
        torch._assert_async((positions < model.config.max_seq_len).all(), "sequence too long for max_seq_len")
    whole = cache.valid.device.type in WHOLE_BUFFER_DEVICES
    steps = _compiled_steps.setdefault(model, {})
    if whole not in steps:
        steps[whole] = _compile_static_step(whole=whole, device=cache.valid.device)
    # The new slot's bookkeeping, here in Python (a Python counter: no read of the device).
    start = cache.reserve(torch.ones_like(tokens, dtype=torch.bool), positions)  # the new slot
    slot = torch.full((1,), start, dtype=torch.long, device=tokens.device)  # made on the device: no copy
    if whole:  # every slot, under the validity mask: static shapes for a CUDA graph
        if cache.valid.device.type == "cuda":  # (on the CPU, freezing would fold static inputs as constants)
            _mark_static(cache)
        return steps[whole](model, tokens, positions, slot, cache.valid, cache.positions, cache)
    # The filled prefix [0, n) only, its length n marked dynamic: one graph serves every step
    # (attending over the whole buffer instead cost batch 16 about a third more time per step on
    # the CPU).
    key_valid, key_positions = cache.valid[:, : start + 1], cache.positions[:, : start + 1]  # (b, n)
    torch._dynamo.maybe_mark_dynamic(key_valid, 1)
    torch._dynamo.maybe_mark_dynamic(key_positions, 1)
    return steps[whole](model, tokens, positions, slot, key_valid, key_positions, cache)


def _mark_static(cache: KVCache) -> None:
    """Mark the cache's buffers as static inputs of the compiled step (once per cache): the CUDA
    graph then reads and writes them in place instead of copying them in at every replay."""
    if getattr(cache, "_static_marked", False):
        return
    for tensor in (cache.valid, cache.positions, *[t for layer in cache.layers for t in (layer.k, layer.v)]):
        torch._dynamo.mark_static_address(tensor)
    cache._static_marked = True  # type: ignore[attr-defined]


def _inputs_only(guards: list) -> list[bool]:
    """Dynamo's guards to keep: all but those on the model's submodules and their attributes
    (each model has its own compiled step, ``_compiled_steps``)."""
    return [not guard.orig_guard.source.is_unspecialized_nn_module() for guard in guards]


def _recompile_limit(limit: int) -> dict[str, object]:
    """torch.compile's keywords for a per-function limit of ``limit`` compiled entries, kept apart
    from other functions' (torch >= 2.12); an older torch has no such keywords, so there the
    process-wide limit is raised instead (``recompile_limit``, ``cache_size_limit`` before 2.6)."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"recompile_limit": limit, "isolate_recompiles": True}
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))
    return {}


def _compile_static_step(*, whole: bool, device: torch.device) -> Callable[..., Tensor]:
    """``_static_step`` under torch.compile: on the CPU called with Inductor's freezing on; over the
    whole buffer with static shapes, replayed as CUDA graphs on a GPU."""
    import torch._inductor.config as inductor_config

    from aiayn.fast import matvec

    matvec.mark_for_compile()
    # Static shapes but the number of filled cache slots (marked dynamic per call): symbolic
    # sizes elsewhere would make slower kernels (and SDPA's enable_gqa a SymBool).
    # Each batch size and cache size of the model is one entry of its compile cache: raise torch's
    # default limit of 8 entries, past which it would refuse to compile again.
    options: dict[str, object] = {"guard_filter_fn": _inputs_only}
    if whole and device.type == "cuda":
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets (mode and options exclude each other)
    compiled = torch.compile(_static_step, fullgraph=True, dynamic=False, **_recompile_limit(64),
                             options=options)
    if device.type != "cpu":  # freezing pre-packs weights for the CPU's matmul library
        return compiled

    def step(*args: object) -> Tensor:
        # Freezing folds the weights into the graph as constants, which lets Inductor pre-pack
        # them for oneDNN's matmuls: the projections that stay F.linear (more rows than
        # aiayn.fast.matvec rewrites) read the weights faster than torch's eager kernels do. Set around
        # every call, since any call may compile (a new shape); torch.compile's options= does not
        # reach the freezing pass.
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return step
