"""A decode step compiled by ``torch.compile`` into one graph: the eager step costs a small model
most of its time in dispatching a few hundred small ops from Python.

It serves a decoder-only model and the decoder of an encoder-decoder (its cross-attention over the
keys and values the eager first step put in the cache, the source length symbolic).

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
from aiayn.models.encoder_decoder import EncoderDecoder
from aiayn.models.step import StepInput, run_step
from aiayn.nn.attention import AttentionInputs
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.kv_layer import Slots
from aiayn.nn.masks import key_mask


def _static_step(model: DecoderOnly | EncoderDecoder, tokens: Tensor, positions: Tensor, slot: Tensor,
                 key_valid: Tensor, key_positions: Tensor, cache: KVCache,
                 memory_valid: Tensor | None = None) -> Tensor:
    """tokens, positions (b, 1) long, ``slot`` (1,) long (the cache slot the new token fills),
    ``key_valid`` (b, n) bool and ``key_positions`` (b, n) long (the cache's first n = slot + 1
    slots, n symbolic, or all of its slots, n = max_len; the new one's already set) -> next-token
    logits (b, v): the graph torch.compile traces. ``memory_valid`` (b, s) bool: an
    encoder-decoder's real source tokens, the keys of its cross-attention (their keys and values
    are in ``cache.cross``)."""
    slots = Slots.slot(slot, key_valid.shape[1])
    return _graph_step(model, tokens, positions, slots, key_valid, key_positions, cache, memory_valid)


def _row_step(model: DecoderOnly, tokens: Tensor, positions: Tensor, slots: Slots, key_valid: Tensor,
              key_positions: Tensor, cache: KVCache) -> Tensor:
    """``_static_step`` over a per-row cache's whole buffer: tokens, positions (b, 1) long,
    ``slots`` (a per-row ``KVCache.reserve``'s: each row's new slot, (b, 1)), key_valid (b, s_max) bool
    and key_positions (b, s_max) long (the new slots already recorded) -> logits (b, v). Each row's
    new key is stored in place at its slot (``Slots.row_slot``).

    Every row also attends to its own new key: a row that only pads the batch up to its graph's
    size (recorded invalid, ``CompiledRows``) may hold no valid key, and a softmax over no key is
    NaN in some kernels (torch's CPU SDPA gives zeros, a plain softmax NaN); its next layers would
    write those NaNs into its slots, and a masked NaN value still poisons a later read (0 x NaN).
    A real row's new slot is valid already: no change."""
    index = slots.index
    assert index is not None
    attend = key_valid.scatter(1, index, True)  # (b, s_max)
    return _graph_step(model, tokens, positions, Slots.row_slot(index, key_valid.shape[1]), attend, key_positions,
                       cache)


def _graph_step(model: DecoderOnly | EncoderDecoder, tokens: Tensor, positions: Tensor, slots: Slots,
                key_valid: Tensor, key_positions: Tensor, cache: KVCache,
                memory_valid: Tensor | None = None) -> Tensor:
    """The decoder's own ``TransformerStack.run`` on inputs built here without reading a tensor into
    Python: attention covers the keys ``key_valid`` marks, the new keys go to ``slots``. Linear
    layers on a few rows run the ways fastest compiled (``MatvecLinears``): at batch 1 a fused
    multiply + sum that reads the weights faster than the matmul."""
    stack = model.decoder
    self_attn = stack.attention_inputs(positions, key_positions, key_mask(key_valid), slots=slots)
    valid = torch.ones_like(tokens, dtype=torch.bool)  # (b, 1): every new token is real
    # (b, 1, 1, s): always a mask (an all-real source is not looked for: that reads the data)
    cross_attn = AttentionInputs(mask=key_mask(memory_valid)) if memory_valid is not None else None
    inputs = StackInputs(positions=positions, valid=valid, self_attn=self_attn, cross_attn=cross_attn)
    with MatvecLinears():
        return run_step(model, StepInput(tokens, inputs), cache)  # (b, v)


# One compiled step per model and layout, its graphs kept apart from other models'
# (``isolate_recompiles``) and dropped with the model (a weak key), instead of one step for all
# told apart by Dynamo's guards on every submodule: those are thousands of checks per call, a
# visible part of a small model's step, so the graphs are guarded on the step's inputs only
# (``_inputs_only``). Layouts: "prefix", "whole" (``compiled_decode_step``), "rows" (``compiled_row_step``).
_compiled_steps: weakref.WeakKeyDictionary[nn.Module, dict[str, Callable[..., Tensor]]] = weakref.WeakKeyDictionary()
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


def compiled_decode_step(model: DecoderOnly | EncoderDecoder, tokens: Tensor, cache: KVCache, *,
                         memory_valid: Tensor | None = None) -> Tensor:
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

    An ``EncoderDecoder``'s decoder: ``memory_valid`` (b, s) marks the real source tokens, and the
    cache holds the cross-attention keys and values already (the eager first step, which takes the
    encoder's memory, put them there); the source length s is symbolic, so one graph serves every
    source length.

    The graph holds the weights as constants (Inductor "freezing"; it keeps its own pre-packed
    copy of them) and is not guarded on the model's submodules: after changing a model in place
    (weights, dtype, layers) by hand, call ``forget_compiled(model)`` before decoding it compiled
    again (aiayn's converters do).
    """
    if cache.quantize is not None:
        raise ValueError("compiled decoding needs a float KV cache; drop compile or the cache quantisation")
    if model.training:
        raise ValueError("compiled decoding runs the eval-mode model; call model.eval() first")
    _check_memory(model, cache, memory_valid)
    check_tokens("tokens", tokens, model.decoder.embedding.num_embeddings)
    if tokens.shape != (cache.batch_size, 1):
        raise ValueError(f"a compiled decode step takes one token per row, shape ({cache.batch_size}, 1), "
                         f"got {tuple(tokens.shape)}")
    # One layout for the ids: a view of a growing target (b, i) would carry another stride every
    # step, and the graph, guarded on strides, would compile again each time.
    tokens = tokens.contiguous()  # (b, 1)
    positions, slots = next_token_slots(model, cache, torch.ones_like(tokens, dtype=torch.bool))
    whole = cache.valid.device.type in WHOLE_BUFFER_DEVICES
    step = _compiled(model, "whole" if whole else "prefix", cache.valid.device)
    if memory_valid is not None:  # the source length: symbolic, one graph for every length
        for tensor in (memory_valid, *[t for kv in cache.cross or [] for t in kv]):
            torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 1 if tensor is memory_valid else 2)
    slot = torch.full((1,), slots.start, dtype=torch.long, device=tokens.device)  # made on the device: no copy
    if whole:  # every slot, under the validity mask: static shapes for a CUDA graph
        if cache.valid.device.type == "cuda":  # (on the CPU, freezing would fold static inputs as constants)
            _mark_static(cache)
        return step(model, tokens, positions, slot, cache.valid, cache.positions, cache, memory_valid)
    # The filled prefix [0, n) only, its length n marked dynamic: one graph serves every step
    # (over the whole buffer the CPU would also compute the unfilled, masked slots).
    key_valid, key_positions = cache.valid[:, : slots.end], cache.positions[:, : slots.end]  # (b, n)
    torch._dynamo.maybe_mark_dynamic(key_valid, 1)
    torch._dynamo.maybe_mark_dynamic(key_positions, 1)
    return step(model, tokens, positions, slot, key_valid, key_positions, cache, memory_valid)


def next_token_slots(model: DecoderOnly | EncoderDecoder, cache: KVCache, real: Tensor
                     ) -> tuple[Tensor, Slots]:
    """The host half of a one-token-per-row step: each row's position (its real tokens so far,
    checked against ``max_seq_len``), (b, 1), and the slots its token writes (``cache.reserve``, which
    checks the cache's capacity); ``real`` (b, 1) bool marks the rows that bring a token."""
    positions = model.decoder.check_positions(cache.next_positions()[:, None])  # (b, 1)
    return positions, cache.reserve(real, positions)


def compiled_row_step(model: DecoderOnly, tokens: Tensor, positions: Tensor, slots: Slots, key_valid: Tensor,
                      key_positions: Tensor, cache: KVCache) -> Tensor:
    """One decode step of a decoder-only model over rows of a per-row ``KVCache`` that are each at their
    own length, through a compiled graph (``_row_step``): tokens, positions (b, 1) long, ``slots``
    (``reserve``'s, one per row), key_valid, key_positions (b, s_max) (the rows' ``valid`` and ``positions``, the new slots
    recorded by ``KVCache.reserve`` beforehand) -> logits (b, v). Every shape is static (the
    whole buffer under the mask): one graph per batch size, whatever the rows' lengths; on CUDA
    replayed as a CUDA graph, the buffers marked static by the caller (``mark_static``).
    ``aiayn.serve.compiled_step`` calls it for the serve engine's decode steps."""
    if model.training:
        raise ValueError("compiled decoding runs the eval-mode model; call model.eval() first")
    return _compiled(model, "rows", key_valid.device)(model, tokens, positions, slots, key_valid, key_positions,
                                                       cache)


def _compiled(model: nn.Module, layout: str, device: torch.device) -> Callable[..., Tensor]:
    """``model``'s compiled step of ``layout`` (made on first use)."""
    steps = _compiled_steps.setdefault(model, {})
    if layout not in steps:
        function = _row_step if layout == "rows" else _static_step
        steps[layout] = _compile_static_step(function, whole=layout != "prefix", device=device)
    return steps[layout]


def _check_memory(model: DecoderOnly | EncoderDecoder, cache: KVCache, memory_valid: Tensor | None) -> None:
    """An encoder-decoder's step needs ``memory_valid`` (b, s) and the cross-attention keys and
    values in the cache (its eager first step with the encoder's memory); a decoder-only one neither."""
    if not isinstance(model, EncoderDecoder):
        if memory_valid is not None:
            raise ValueError("memory_valid is for an encoder-decoder's decoder; a decoder-only model has no source")
        return
    if memory_valid is None:
        raise ValueError("an encoder-decoder's compiled step needs memory_valid (batch, source length)")
    if cache.cross is None:
        raise ValueError("the compiled step continues a cache whose cross-attention keys and values are "
                         "filled: run the first step (bos, with the encoder's memory) without compile")
    if memory_valid.shape != (cache.batch_size, cache.cross[0][0].shape[2]):
        raise ValueError(f"memory_valid must be (batch, source length) = "
                         f"{(cache.batch_size, cache.cross[0][0].shape[2])}, got {tuple(memory_valid.shape)}")


def reorder_rows_in_place(cache: KVCache, rows: Tensor) -> None:
    """``cache.reorder(rows, cross=False)`` for a batch of the same size, written into the cache's
    own buffers: new row i is old row ``rows[i]`` (rows (b,) long, every row replaced by one with
    the same source). A compiled step's graph, and a CUDA graph's static buffer addresses, stay
    valid; nothing is read back from the device (beam search's compiled steps follow their beams
    with it)."""
    if rows.shape != (cache.batch_size,):
        raise ValueError(f"an in-place reorder keeps the batch of {cache.batch_size} rows, got rows of shape "
                         f"{tuple(rows.shape)}")
    n = cache.length
    for layer in cache.layers:  # (b, h_kv, s_max, d_h) each: the filled slots only
        layer.k[:, :, :n] = layer.k[:, :, :n].index_select(0, rows)
        layer.v[:, :, :n] = layer.v[:, :, :n].index_select(0, rows)
    cache.valid.copy_(cache.valid.index_select(0, rows))  # (b, s_max)
    cache.positions.copy_(cache.positions.index_select(0, rows))


def _mark_static(cache: KVCache) -> None:
    """Mark the cache's buffers as static inputs of the compiled step (once per cache): the CUDA
    graph then reads and writes them in place instead of copying them in at every replay."""
    if getattr(cache, "_static_marked", False):
        return
    cross = [t for kv in cache.cross or [] for t in kv]
    mark_static(cache.valid, cache.positions, *[t for layer in cache.layers for t in (layer.k, layer.v)], *cross)
    cache._static_marked = True  # type: ignore[attr-defined]


def mark_static(*tensors: Tensor) -> None:
    """Mark buffers that keep their storage from step to step (a cache's) as static inputs of the
    compiled steps: a CUDA graph reads and writes them in place instead of copying them in at every
    replay (and a graph that writes an input must have it static to be replayed at all)."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


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


def _compile_static_step(function: Callable[..., Tensor], *, whole: bool, device: torch.device
                         ) -> Callable[..., Tensor]:
    """``function`` (``_static_step``, ``_row_step``) under torch.compile: on the CPU called with
    Inductor's freezing on; over the whole buffer with static shapes, replayed as CUDA graphs on a GPU."""
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
    compiled = torch.compile(function, fullgraph=True, dynamic=False, **_recompile_limit(64),
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
