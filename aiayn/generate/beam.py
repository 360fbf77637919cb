"""Beam search over the KV cache with GNMT's length penalty, for encoder-decoder models (the paper's
translation search) and decoder-only ones: one loop, ``_search``, runs every source's open beams as
rows of one batch; each source keeps its ``beam`` best finished hypotheses (``hypotheses.Finished``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from aiayn.cpu_share import share_cores
from aiayn.generate.decoder_only import cache_slots, prompt_validity
from aiayn.generate.encoder_decoder import greedy_encoder_decoder, max_target_lengths
from aiayn.generate.ensemble import Ensemble, EnsembleCache
from aiayn.generate.hypotheses import (
    NEG_INF,
    Beams,
    BeamSearchResult,
    BeamStep,
    Finished,
    choose,
    gnmt_length_penalty,
    trace_step,
)
from aiayn.generate.results import DoneCheck
from aiayn.generate.static_search import follow_in_place, static_search
from aiayn.generate.step import decode_step
from aiayn.models.decoder_only import DecoderOnly
from aiayn.models.encoder_decoder import EncoderDecoder
from aiayn.nn.kv_cache import KVCache


@torch.inference_mode()
def beam_search_encoder_decoder(
    model: EncoderDecoder | Ensemble,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    length_penalty: float = 0.6,
    min_len: int = 0,
    src_valid: Tensor | None = None,
    n_best: int = 1,
    early_stopping: bool = False,
    keep_greedy: bool = False,
    trace: Callable[[BeamStep], None] | None = None,
    compile: bool = False,
) -> BeamSearchResult:
    """Beam search with the paper's defaults (section 6.1): beam 4, alpha 0.6, at most source length + 50.

    Hypotheses rank by float32 log-probability sums over GNMT's ``lp(n) = ((5 + n) / 6) ** alpha``, n
    counting eos; at most ``floor(max_len_a * src_len + max_len_b)`` tokens (capped by max_seq_len);
    ``min_len`` forbids an earlier eos; pad_id is never a candidate. Each step, of the 2 * beam best
    continuations an eos one within the first ``beam`` finishes and the first ``beam`` others go on
    (fairseq, Hugging Face); a source stops once no open beam can beat its worst finished one (with
    ``early_stopping``: once it has ``beam``). ``model`` may be an ``Ensemble``; ``keep_greedy``: the
    greedy hypothesis joins the finished; ``trace``: a ``BeamStep`` per step; ``compile``: static shapes."""
    _check_search(beam_size, n_best, compile=compile, trace=trace)
    pad_id = model.config.pad_id
    fill_id = pad_id if pad_id is not None else eos_id
    b, k = src.shape[0], beam_size

    encoded = model.encode(src, src_valid=src_valid)  # once per source: memory (b, s, d)
    limits = max_target_lengths(encoded.valid, max_len_a=max_len_a, max_len_b=max_len_b,
                                cap=model.config.max_seq_len)  # (b,)
    cache = model.new_cache(b, cache_slots(int(limits.max()), compile))  # bos + at most n_max - 1 fed tokens
    bos = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)
    # (b, v); fills the cross-attention k/v once
    logits = decode_step(model, bos, cache, memory=encoded.memory, memory_valid=encoded.valid)
    memory_valid = encoded.valid.repeat_interleave(k, dim=0)  # (b * k, s): source i's beams share its row

    def step(tokens: Tensor, rows: Tensor, dropped: bool) -> Tensor:
        nonlocal memory_valid
        if dropped:  # a source left: its rows go (within a source the rows are all the same)
            memory_valid = memory_valid.index_select(0, rows)
        return decode_step(model, tokens, cache, memory_valid=memory_valid, compile=compile)

    finished = _search(logits, cache, limits, step, k=k, eos_id=eos_id, pad_id=pad_id, fill_id=fill_id,
                       alpha=length_penalty, min_len=min_len, early_stopping=early_stopping, trace=trace,
                       static=static_search(compile, src.device, trace is not None))
    if keep_greedy:
        _merge_greedy(model, src, src_valid, limits, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                      fill_id=fill_id, min_len=min_len, alpha=length_penalty, finished=finished)
    return finished.result(n_best)


@torch.inference_mode()
def beam_search_decoder_only(
    model: DecoderOnly,
    prompt: Tensor,
    *,
    eos_id: int | None,
    max_new_tokens: int,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    prompt_valid: Tensor | None = None,
    min_len: int = 0,
    n_best: int = 1,
    early_stopping: bool = False,
    trace: Callable[[BeamStep], None] | None = None,
    compile: bool = False,
) -> BeamSearchResult:
    """``beam_search_encoder_decoder``'s rules continuing each row of ``prompt`` (b, t), left-padded per
    ``prompt_valid``, by at most ``max_new_tokens``; hypotheses hold the new tokens (``eos_id`` None:
    all run to the limit)."""
    _check_search(beam_size, n_best, compile=compile, trace=trace)
    b, t = prompt.shape
    if max_new_tokens < 1 or t + max_new_tokens > model.config.max_seq_len:
        raise ValueError(f"prompt of {t} tokens + {max_new_tokens} new tokens must fit the model's context of "
                         f"{model.config.max_seq_len} (and max_new_tokens >= 1)")
    valid = prompt_validity(model, prompt, prompt_valid)  # (b, t)
    pad_id = model.config.pad_id
    fill_id = pad_id if pad_id is not None else eos_id if eos_id is not None else 0
    if eos_id is None:  # no token ends a hypothesis: -1 is no candidate's id
        eos_id, min_len = -1, 0
    limits = torch.full((b,), max_new_tokens, dtype=torch.long, device=prompt.device)
    # the prompt + at most max_new_tokens - 1 fed tokens
    cache = model.new_cache(b, cache_slots(t + max_new_tokens, compile))
    logits = decode_step(model, prompt, cache, valid=valid)  # (b, v)

    def step(tokens: Tensor, rows: Tensor, dropped: bool) -> Tensor:
        if compile:  # (every fed token is real: the compiled step's rule)
            return decode_step(model, tokens, cache, compile=True)
        return decode_step(model, tokens, cache, valid=torch.ones_like(tokens, dtype=torch.bool))

    finished = _search(logits, cache, limits, step, k=beam_size, eos_id=eos_id, pad_id=pad_id, fill_id=fill_id,
                       alpha=length_penalty, min_len=min_len, early_stopping=early_stopping, trace=trace,
                       static=static_search(compile, prompt.device, trace is not None))
    return finished.result(n_best)


def _check_search(beam_size: int, n_best: int, *, compile: bool, trace: Callable[[BeamStep], None] | None) -> None:
    if beam_size < 1 or not 1 <= n_best <= beam_size:
        raise ValueError(f"need beam_size >= 1 and 1 <= n_best <= beam_size, got beam_size={beam_size}, "
                         f"n_best={n_best}")
    if compile and trace is not None:
        raise ValueError("trace= follows the eager search (its steps name the sources still searching); "
                         "drop compile to trace a search")


def _search(logits: Tensor, cache: KVCache | EnsembleCache, limits: Tensor, step: Callable[[Tensor, Tensor, bool], Tensor], *,
            k: int, eos_id: int, pad_id: int | None, fill_id: int, alpha: float, min_len: int,
            early_stopping: bool, trace: Callable[[BeamStep], None] | None, static: bool = False) -> Finished:
    """The search both architectures share: ``logits`` (b, v) of the first new token, ``cache`` of b rows
    (expanded to b * k), ``limits`` (b,); ``step(tokens (m, 1), rows (m,), dropped)`` -> logits (m, v).
    ``static``: all b * k rows kept to the end (stopped sources scored -inf), the cache following the
    beams in its own buffers: fixed shapes, no host-device sync per step."""
    device, b = logits.device, logits.shape[0]
    n_max = int(limits.max())
    v = logits.shape[-1]
    cache.repeat_interleave(k)  # (b * k) rows: source i's beams are rows i*k .. i*k + k-1
    lprobs = torch.log_softmax(logits.float(), dim=-1).repeat_interleave(k, dim=0).view(b, k, v)

    # Open beams of the sources still searching (n of them; `alive` maps them to source ids).
    alive = torch.arange(b, device=device)  # (n,)
    beams = Beams(scores=torch.full((b, k), NEG_INF, device=device),
                  tokens=torch.full((b, k, n_max), fill_id, dtype=torch.long, device=device),
                  token_scores=torch.zeros(b, k, n_max, device=device))
    beams.scores[:, 0] = 0.0  # at the first step only beam 0 is real (all beams are equal)
    finished = Finished.empty(b, k, n_max, fill_id, device)

    # The static search reads "has every source stopped?" a step late on a GPU (``DoneCheck``).
    check = DoneCheck(device)
    for t in range(1, n_max + 1):  # t: length of the hypotheses after this step
        share_cores()  # this job's fair share of the cores beside other aiayn jobs (aiayn/cpu_share.py)
        n = alive.shape[0]
        beams, c = choose(t, beams, finished, lprobs, alive, limits, k=k, eos_id=eos_id, pad_id=pad_id,
                           min_len=min_len, alpha=alpha, early_stopping=early_stopping)
        next_beam, next_tok, done = c.next_beam, c.next_tok, c.done
        if trace is not None:
            trace_step(trace, t, alive, c, k)
        if static:  # a stopped source changes nothing more, so the stop may be read a step late
            if t == n_max or check.stopped_before() or check.after(done):  # (at n_max every source is done)
                break
            beams.scores.masked_fill_(done[:, None], NEG_INF)  # a stopped source proposes nothing more
            rows = (torch.arange(n, device=device)[:, None] * k + next_beam).reshape(-1)  # (n * k,) parents
            follow_in_place(cache, rows)
            lprobs = torch.log_softmax(step(next_tok.reshape(-1, 1), rows, False).float(), dim=-1).view(n, k, v)
            continue
        if bool(done.all()):
            break

        # Follow the kept beams (and drop finished sources) in the cache, then feed the new tokens.
        stay = (~done).nonzero().squeeze(1)  # (n_new,) local ids of sources still searching
        rows = (stay[:, None] * k + next_beam[stay]).reshape(-1)  # (n_new * k,) parent rows
        dropped = bool(done.any())
        cache.reorder(rows, cross=dropped)  # cross k/v only change when a source leaves
        if dropped:
            alive = alive[stay]
            beams = beams.select(stay)
        step_logits = step(next_tok[stay].reshape(-1, 1), rows, dropped)
        lprobs = torch.log_softmax(step_logits.float(), dim=-1).view(stay.shape[0], k, v)  # (n_new, k, v)

    return finished


def _merge_greedy(model: EncoderDecoder | Ensemble, src: Tensor, src_valid: Tensor | None, limits: Tensor, *,
                  bos_id: int, eos_id: int, pad_id: int | None, fill_id: int, min_len: int, alpha: float,
                  finished: Finished) -> None:
    """Insert each source's greedy hypothesis into its finished ones (unless there or ranked below all)."""
    greedy = greedy_encoder_decoder(model, src, bos_id=bos_id, eos_id=eos_id, max_new_tokens=limits,
                                    src_valid=src_valid)
    assert greedy.lengths is not None
    # (b, n) log-probability of each greedy token
    token_lp = torch.log_softmax(greedy.logits.float(), dim=-1).gather(2, greedy.tokens[:, :, None])[:, :, 0]
    k = finished.norm.shape[1]
    for i in range(src.shape[0]):
        n = int(greedy.lengths[i])
        tokens = greedy.tokens[i, :n]
        ids = tokens.tolist()
        if (pad_id is not None and pad_id in ids) or (eos_id in ids and ids.index(eos_id) < min_len):
            continue  # a hypothesis the search never proposes
        score = float(token_lp[i, :n].sum())
        norm = score / float(gnmt_length_penalty(torch.tensor(n), alpha))
        if norm <= float(finished.norm[i, k - 1]):
            continue  # ranks below every kept hypothesis (ties keep the search's)
        if any(int(finished.length[i, j]) == n and torch.equal(finished.tokens[i, j, :n], tokens)
               for j in range(k)):
            continue  # the search found it too
        slot = int((finished.norm[i] >= norm).sum())  # after the hypotheses that rank at least as high
        finished.insert(i, slot, norm=norm, score=score, tokens=tokens, token_scores=token_lp[i, :n],
                        fill_id=fill_id)
