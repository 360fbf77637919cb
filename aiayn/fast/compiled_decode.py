"""A decode step compiled by ``torch.compile`` into one graph (the eager step costs a small model most
of its time dispatching small ops from Python), for a decoder-only model or an encoder-decoder's
decoder. It runs the eager model's ``TransformerStack`` in one of two layouts:

* **the filled prefix** (the CPU): every shape fixed but the filled prefix's length, marked dynamic;
  linear layers on a few rows as ``aiayn.fast.matvec`` measured fastest, weights frozen in;
* **the whole buffer** (CUDA): attention over every slot under the validity mask, all shapes static,
  replayed as a CUDA graph over static cache buffers (gpt-fast's and Hugging Face's StaticCache's
  recipe). Unfilled slots are masked keys: the result is the prefix layout's.
"""

from __future__ import annotations

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
    """The traced graph: tokens, positions (b, 1), ``slot`` (1,) the new token's, ``key_valid`` (b, n) and
    ``key_positions`` (b, n) (the first n = slot + 1 slots, or all of them) -> logits (b, v).
    ``memory_valid`` (b, s): an encoder-decoder's real source tokens (their k, v in ``cache.cross``)."""
    slots = Slots.slot(slot, key_valid.shape[1])
    return _graph_step(model, tokens, positions, slots, key_valid, key_positions, cache, memory_valid)


def _row_step(model: DecoderOnly, tokens: Tensor, positions: Tensor, slots: Slots, key_valid: Tensor,
              key_positions: Tensor, cache: KVCache) -> Tensor:
    """``_static_step`` over a per-row cache's whole buffer: ``slots`` each row's new slot (b, 1),
    key_valid, key_positions (b, s_max) -> logits (b, v).

    Every row also attends to its own new key: a row that only pads the batch (recorded invalid)
    may hold no valid key, and a softmax over no key is NaN in some kernels; its next layers would
    write those NaNs into its slots, which a masked read still sees (0 x NaN)."""
    index = slots.index
    assert index is not None
    attend = key_valid.scatter(1, index, True)  # (b, s_max)
    return _graph_step(model, tokens, positions, Slots.row_slot(index, key_valid.shape[1]), attend, key_positions,
                       cache)


def _graph_step(model: DecoderOnly | EncoderDecoder, tokens: Tensor, positions: Tensor, slots: Slots,
                key_valid: Tensor, key_positions: Tensor, cache: KVCache,
                memory_valid: Tensor | None = None) -> Tensor:
    """The decoder's ``TransformerStack.run`` on inputs built here without reading a tensor into Python:
    attention over the keys ``key_valid`` marks, the new keys to ``slots``, few-row linear layers
    through ``MatvecLinears``."""
    stack = model.decoder
    self_attn = stack.attention_inputs(positions, key_positions, key_mask(key_valid), slots=slots)
    valid = torch.ones_like(tokens, dtype=torch.bool)  # (b, 1): every new token is real
    # (b, 1, 1, s): always a mask (an all-real source is not looked for: that reads the data)
    cross_attn = AttentionInputs(mask=key_mask(memory_valid)) if memory_valid is not None else None
    inputs = StackInputs(positions=positions, valid=valid, self_attn=self_attn, cross_attn=cross_attn)
    with MatvecLinears():
        return run_step(model, StepInput(tokens, inputs), cache)  # (b, v)


# One compiled step per model and layout ("prefix", "whole", "rows"), dropped with the model, and
# guarded on the step's inputs only (``_inputs_only``): Dynamo's guards on every submodule would be
# thousands of checks per call, a visible part of a small model's step.
_compiled_steps: weakref.WeakKeyDictionary[nn.Module, dict[str, Callable[..., Tensor]]] = weakref.WeakKeyDictionary()
# The devices whose compiled step attends over the whole cache buffer (static shapes, CUDA graphs);
# elsewhere over the filled prefix (tests put "cpu" here to check the CUDA layout on a CPU).
WHOLE_BUFFER_DEVICES: tuple[str, ...] = ("cuda",)


def forget_compiled(model: nn.Module) -> None:
    """Drop ``model``'s compiled decode graphs: call it after changing the model in place by hand (its
    weights, dtype or layers); aiayn's converters call it themselves."""
    _compiled_steps.pop(model, None)


def compiled_decode_step(model: DecoderOnly | EncoderDecoder, tokens: Tensor, cache: KVCache, *,
                         memory_valid: Tensor | None = None) -> Tensor:
    """One decode step, tokens (b, 1) -> logits (b, v), through a graph compiled per model and shape
    (the first call compiles, as does another batch or cache size); equal to the eager step up to
    float rounding (tests/consistency/test_compiled_decode.py). What ``forward`` checks is checked here.

    An ``EncoderDecoder``: ``memory_valid`` (b, s) marks the real source tokens, whose cross-attention
    k, v the eager first step put in the cache; s is symbolic (one graph for every source length).
    The graph holds the weights as constants and is not guarded on the model: after changing it in
    place by hand, call ``forget_compiled(model)``.
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
    # A view of a growing target would carry another stride every step: a recompile each time.
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
    # The filled prefix [0, n) only, n dynamic: one graph for every step, no masked slots computed.
    key_valid, key_positions = cache.valid[:, : slots.end], cache.positions[:, : slots.end]  # (b, n)
    torch._dynamo.maybe_mark_dynamic(key_valid, 1)
    torch._dynamo.maybe_mark_dynamic(key_positions, 1)
    return step(model, tokens, positions, slot, key_valid, key_positions, cache, memory_valid)


def next_token_slots(model: DecoderOnly | EncoderDecoder, cache: KVCache, real: Tensor
                     ) -> tuple[Tensor, Slots]:
    """The host half of a one-token-per-row step: each row's position (b, 1), checked, and the slots its
    token writes (``cache.reserve``); ``real`` (b, 1) bool marks the rows that bring a token."""
    positions = model.decoder.check_positions(cache.next_positions()[:, None])  # (b, 1)
    return positions, cache.reserve(real, positions)


def compiled_row_step(model: DecoderOnly, tokens: Tensor, positions: Tensor, slots: Slots, key_valid: Tensor,
                      key_positions: Tensor, cache: KVCache) -> Tensor:
    """A decoder-only step over the rows of a per-row ``KVCache``, each at its own length, compiled
    (``_row_step``): tokens, positions (b, 1), ``slots`` (``reserve``'s), key_valid, key_positions
    (b, s_max), the new slots recorded -> logits (b, v). All shapes static: one graph per batch size
    (a CUDA graph over buffers the caller marks static, ``mark_static``); the serve engine's step."""
    if model.training:
        raise ValueError("compiled decoding runs the eval-mode model; call model.eval() first")
    return _compiled(model, "rows", key_valid.device)(model, tokens, positions, slots, key_valid, key_positions,
                                                       cache)


def _compiled(model: nn.Module, layout: str, device: torch.device) -> Callable[..., Tensor]:
    steps = _compiled_steps.setdefault(model, {})
    if layout not in steps:
        function = _row_step if layout == "rows" else _static_step
        steps[layout] = _compile_static_step(function, whole=layout != "prefix", device=device)
    return steps[layout]


def _check_memory(model: DecoderOnly | EncoderDecoder, cache: KVCache, memory_valid: Tensor | None) -> None:
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
    """``cache.reorder(rows, cross=False)`` in the cache's own buffers (rows (b,) long, each replaced by one
    of the same source): a compiled graph's static buffer addresses stay valid, nothing is read back."""
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
    if getattr(cache, "_static_marked", False):
        return
    cross = [t for kv in cache.cross or [] for t in kv]
    mark_static(cache.valid, cache.positions, *[t for layer in cache.layers for t in (layer.k, layer.v)], *cross)
    cache._static_marked = True  # type: ignore[attr-defined]


def mark_static(*tensors: Tensor) -> None:
    """Mark buffers that keep their storage (a cache's) as static inputs of the compiled steps: a CUDA
    graph reads and writes them in place (and must, to replay a graph that writes an input)."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


def _inputs_only(guards: list) -> list[bool]:
    """Dynamo's guards but those on the model's submodules (each model has its own compiled step)."""
    return [not guard.orig_guard.source.is_unspecialized_nn_module() for guard in guards]


def _compile_static_step(function: Callable[..., Tensor], *, whole: bool, device: torch.device
                         ) -> Callable[..., Tensor]:
    """``function`` under torch.compile: on the CPU called with Inductor's freezing on; on a GPU over the
    whole buffer, replayed as CUDA graphs."""
    import torch._inductor.config as inductor_config

    from aiayn.fast import matvec

    matvec.mark_for_compile()
    # Static shapes but the filled slots (symbolic sizes elsewhere make slower kernels). Each batch and
    # cache size is one entry of the function's own compile cache: past torch's default of 8 it would
    # refuse to compile again.
    options: dict[str, object] = {"guard_filter_fn": _inputs_only}
    if whole and device.type == "cuda":
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets (mode and options exclude each other)
    compiled = torch.compile(function, fullgraph=True, dynamic=False, recompile_limit=64, isolate_recompiles=True,
                             options=options)
    if device.type != "cpu":  # freezing pre-packs weights for the CPU's matmul library
        return compiled

    def step(*args: object) -> Tensor:
        # Freezing folds the weights in as constants, pre-packed for oneDNN's matmuls. Set around every
        # call, since any call may compile; torch.compile's options= does not reach the freezing pass.
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return step
