"""Decoder-only generation: one decode loop, ``stream_decoder_only`` (the prompt once into a KV cache,
then one token per row per step; past the context it slides, ``aiayn.generate.window``), and the
functions that collect it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypedDict, Unpack

import torch
from torch import Tensor

from aiayn.cpu_share import share_cores
from aiayn.generate import results
from aiayn.generate.results import DecodeStep, DoneCheck, GreedyResult, fill_finished, fill_id_for
from aiayn.generate.sampling import SamplingConfig, TokenChooser
from aiayn.generate.step import decode_step
from aiayn.generate.window import keep_tokens, slide_window
from aiayn.models.decoder_only import DecoderOnly
from aiayn.nn.masks import valid_tokens


class DecodeOptions(TypedDict, total=False):
    """The options of ``stream_decoder_only`` that the functions collecting it pass on."""

    prompt_valid: Tensor | None
    eos_id: int | None
    kv_cache: str | None
    compile: bool
    slide: bool


class RowConstraint(Protocol):
    """What the loop asks of a row's grammar (``aiayn.generate.constrain.GrammarConstraint`` is one)."""

    def reset(self) -> None: ...

    def mask_logits(self, logits: Tensor) -> Tensor: ...

    def advance(self, token: int) -> None: ...

    def is_finished(self) -> bool: ...


def stream_decoder_only(
    model: DecoderOnly,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    prompt_valid: Tensor | None = None,
    eos_id: int | None = None,
    fill_id: int | None = None,
    kv_cache: str | None = None,
    compile: bool = False,
    use_cache: bool = True,
    slide: bool = True,
    constraints: Sequence[RowConstraint | None] | None = None,
) -> Iterator[DecodeStep]:
    """Continue each row of ``prompt`` (b, t), yielding one ``DecodeStep`` per new token, lazily.

    sampling: None = greedy. prompt_valid (b, t): the real tokens of left-padded rows (default:
    ``valid_tokens``). eos_id: a row that emits it is done and holds ``fill_id`` (default: pad_id,
    else eos_id). kv_cache: "int8" / "int4". compile: the steps after the prompt compiled. use_cache:
    False recomputes every step (the reference). slide: past the context a row keeps its last
    ``keep_tokens(context)`` tokens; False: prompt + ``max_new_tokens`` must fit. constraints: one
    grammar per row (None: free) masking its logits; a finished grammar ends its row."""
    t, context = prompt.shape[1], model.config.max_seq_len
    if slide and t > context:
        raise ValueError(f"prompt of {t} tokens exceeds the model's context of {context}; shorten the prompt")
    if not slide and t + max_new_tokens > context:
        raise ValueError(f"prompt of {t} tokens + {max_new_tokens} new tokens exceeds the model's context "
                         f"of {context}; shorten the prompt, ask for fewer tokens or slide (slide=True)")
    if compile and not use_cache:
        raise ValueError("compile=True decodes through the KV cache; it needs use_cache=True")
    if compile and kv_cache is not None:
        raise ValueError("compiled decoding needs a float KV cache; drop compile or the cache quantisation")
    if constraints is not None and len(constraints) != prompt.shape[0]:
        raise ValueError(f"{len(constraints)} constraints for {prompt.shape[0]} prompt rows; give one per row "
                         f"(None for a free row)")
    valid = prompt_validity(model, prompt, prompt_valid)  # (b, t)
    fill_id = fill_id_for(model.config.pad_id, eos_id, fill_id) if eos_id is not None else None
    return _decode(model, prompt, valid, max_new_tokens=max_new_tokens, chooser=TokenChooser(sampling, prompt.device),
                   eos_id=eos_id, fill_id=fill_id, kv_cache=kv_cache, compile=compile, use_cache=use_cache,
                   slide=slide, constraints=list(constraints) if constraints is not None else None)


@torch.inference_mode()
def _decode(model: DecoderOnly, prompt: Tensor, valid: Tensor, *, max_new_tokens: int, chooser: TokenChooser,
            eos_id: int | None, fill_id: int | None, kv_cache: str | None, compile: bool,
            use_cache: bool, slide: bool, constraints: list[RowConstraint | None] | None) -> Iterator[DecodeStep]:
    """``stream_decoder_only``'s loop on checked arguments."""
    b, t = prompt.shape
    context = model.config.max_seq_len
    slides = slide and t + max_new_tokens > context  # past the context a row's window holds at most it
    width = context if slides else t + max_new_tokens  # the slots its tokens take
    # The ids fed so far (b, width): the repetition penalty's input and a slide's source.
    history = penalty_history(prompt, valid, width - t) if chooser.needs_history or (slides and use_cache) else None
    cache = model.new_cache(b, cache_slots(width, compile), quantize=kv_cache) if use_cache else None
    keep = keep_tokens(context)
    # Each row's real tokens at the last (pre)fill and the tokens fed since, on the host.
    filled = valid.sum(dim=1).tolist() if slides else [0]
    longest, grown = max(filled), 0
    # What the next call reads: the prompt (or a slid window), then the last token or (no cache) all.
    inputs, inputs_valid = prompt, valid
    one_real = torch.ones(b, 1, dtype=torch.bool, device=prompt.device)  # generated tokens are real
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    fresh, slid = True, False  # fresh: this call prefills (eager, with validity); slid: after a slide
    steered = _steered_rows(constraints)
    # Only eos or a grammar ends a row; read at once where a grammar reads the tokens anyway.
    check = DoneCheck(prompt.device if not steered else torch.device("cpu")) if eos_id is not None or steered else None
    for i in range(max_new_tokens):
        share_cores()  # this job's fair share of the cores beside other aiayn jobs (aiayn/cpu_share.py)
        if cache is None:
            logits = model(inputs, valid=inputs_valid).logits[:, -1]  # (b, v)
        elif compile and not fresh:
            logits = decode_step(model, inputs, cache, compile=True)
        else:
            logits = decode_step(model, inputs, cache, valid=inputs_valid)  # (b, v)
        if steered:  # each steered row's forbidden tokens masked, in a copy
            logits = logits.clone()
            for row in steered:
                constraints[row].mask_logits(logits[row])  # type: ignore[index]
        fed = inputs.shape[1] if cache is None else cache.length  # slots the model has seen
        ids_so_far = history[:, :fed] if history is not None else None  # (b, fed)
        token = fill_finished(chooser.choose(logits, ids_so_far), done, fill_id)  # (b,)
        active = ~done
        if eos_id is not None:
            done = done | (token == eos_id)
        if steered:
            steered, done = _advance_steered(constraints, steered, token, done, eos_id)
        if check is not None and check.stopped_before():
            return  # (lagged) the step before ended every row: this one is dropped
        yield DecodeStep(index=i, tokens=token, logits=logits, active=active, done=done, cache=cache, slid=slid)
        if i + 1 == max_new_tokens or (check is not None and check.after(done)):
            return
        fresh = slid = False
        if slides and (fed >= width or longest + grown >= context):  # the token has no slot or position
            if cache is None:  # inputs hold every token fed
                ids_fed, valid_fed = inputs, inputs_valid  # (b, fed) each
            else:
                assert history is not None  # kept whenever the loop slides over a cache
                ids_fed, valid_fed = history[:, :fed], cache.valid[:, :fed]
            real = [n + grown + 1 for n in filled]  # each row's real tokens, the new one counted
            inputs, inputs_valid, filled = slide_window(ids_fed, valid_fed, token, real, context=context, keep=keep)
            longest, grown = max(filled), 0
            if cache is not None:
                cache.reset()  # the same buffers: a compiled step's graph (its shapes) stays valid
            if history is not None:
                history[:, : inputs.shape[1]] = torch.where(inputs_valid, inputs, inputs[:, -1:])
            fresh = slid = True
            continue
        grown += 1
        if history is not None:
            history[:, fed] = token
        if cache is None:
            inputs = torch.cat([inputs, token[:, None]], dim=1)
            inputs_valid = torch.cat([inputs_valid, one_real], dim=1)
        else:
            inputs, inputs_valid = token[:, None], one_real


def _steered_rows(constraints: list[RowConstraint | None] | None) -> list[int]:
    """The rows a grammar steers, their grammars reset."""
    steered = [i for i, c in enumerate(constraints or []) if c is not None]
    for i in steered:
        constraints[i].reset()  # type: ignore[index, union-attr]
    return steered


def _advance_steered(constraints: Any, steered: list[int], token: Tensor, done: Tensor,
                     eos_id: int | None) -> tuple[list[int], Tensor]:
    """Feed each steered row's token to its grammar: (the rows still steered, done updated)."""
    chosen = token.tolist()  # the grammar's read
    for row in steered:
        constraints[row].advance(chosen[row])
    ended = [row for row in steered if constraints[row].is_finished()]
    steered = [row for row in steered if row not in ended and chosen[row] != eos_id]
    if ended:
        done = done.clone()
        done[ended] = True
    return steered, done


@torch.inference_mode()
def greedy_decoder_only(model: DecoderOnly, prompt: Tensor, *, max_new_tokens: int, use_cache: bool = True,
                        **options: Unpack[DecodeOptions]) -> GreedyResult:
    """The argmax continuation of each row of ``prompt`` (b, t); the options are ``stream_decoder_only``'s."""
    results.known_options("greedy_decoder_only", options, DecodeOptions)
    return GreedyResult.from_steps(stream_decoder_only(
        model, prompt, max_new_tokens=max_new_tokens, use_cache=use_cache, **options))


@torch.inference_mode()
def generate_decoder_only(model: DecoderOnly, prompt: Tensor, *, max_new_tokens: int,
                          sampling: SamplingConfig | None = None,
                          on_token: Callable[[Tensor], bool | None] | None = None,
                          **options: Unpack[DecodeOptions]) -> Tensor:
    """Sample a continuation of ``prompt`` (b, t) -> new ids (b, n <= max_new_tokens); after eos a row
    repeats eos. ``on_token`` gets each step's (b,) ids; returning True stops. Options: ``stream_decoder_only``'s."""
    results.known_options("generate_decoder_only", options, DecodeOptions)
    generated: list[Tensor] = []
    steps = stream_decoder_only(model, prompt, max_new_tokens=max_new_tokens, sampling=sampling or SamplingConfig(),
                                fill_id=options.get("eos_id"), **options)
    for step in steps:
        generated.append(step.tokens)
        if on_token is not None and on_token(step.tokens):
            steps.close()
            break
    return torch.stack(generated, dim=1)


def prompt_validity(model: DecoderOnly, prompt: Tensor, prompt_valid: Tensor | None) -> Tensor:
    """(b, t) bool, True at the prompt's real tokens; ValueError if a row has no real token."""
    try:
        valid = valid_tokens(prompt, model.config.pad_id, prompt_valid)
    except (TypeError, ValueError) as exc:  # only a given prompt_valid can be wrong
        got = (f"{prompt_valid.dtype} {tuple(prompt_valid.shape)}" if isinstance(prompt_valid, Tensor)
               else type(prompt_valid).__name__)
        raise ValueError(f"prompt_valid must be a bool tensor of the prompt's shape {tuple(prompt.shape)}, "
                         f"got {got}") from exc
    if not bool(valid.any(dim=1).all()):
        raise ValueError("a prompt row has no real token (all padding); drop it or give a token")
    return valid


def penalty_history(prompt: Tensor, valid: Tensor, max_new_tokens: int) -> Tensor:
    """The repetition penalty's id buffer (b, t + max_new_tokens): the prompt, padding as the last token."""
    b, t = prompt.shape
    history = torch.empty(b, t + max_new_tokens, dtype=prompt.dtype, device=prompt.device)
    history[:, :t] = torch.where(valid, prompt, prompt[:, -1:])
    return history


COMPILED_CACHE_MULTIPLE = 64  # compiled decoding rounds its cache up to this, so lengths share graphs


def cache_slots(n: int, compile: bool) -> int:
    """Cache slots for n tokens: n, or (compiled) n rounded up (the buffer size is part of a graph's shapes)."""
    return -(-n // COMPILED_CACHE_MULTIPLE) * COMPILED_CACHE_MULTIPLE if compile else n
