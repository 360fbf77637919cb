"""Beam search over the KV cache with GNMT's length penalty: for encoder-decoder models
(``beam_search_encoder_decoder``, the paper's translation search) and for decoder-only ones
(``beam_search_decoder_only``), one search loop (``_search``) for both.

Every source's ``beam`` open hypotheses run as rows of one (n * beam) batch (n: the sources still
searching); each source keeps its ``beam`` best finished hypotheses in fixed-size tensors
(``aiayn.generate.hypotheses.Finished``). With ``compile=True`` the steps after the first run
through the compiled decode step (``aiayn.fast.compiled_decode``) over static shapes: the batch
keeps every source's rows to the end (a stopped source's beams are masked, not dropped) and the
cache follows the kept beams in its own buffers, so one graph serves every step (a CUDA graph on a
GPU). ``beam_search_encoder_decoder``'s docstring gives the rules; the tests check them against
greedy decoding, an exhaustive search, a plain Python search and Hugging Face.
"""

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
    Hypothesis,  # noqa: F401  (re-exported: aiayn.generate.beam.Hypothesis)
    choose,
    gnmt_length_penalty,
    trace_step,
)
from aiayn.generate.static_search import follow_in_place, static_search
from aiayn.generate.step import decode_step
from aiayn.generate.results import DoneCheck
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
    mask_pad: bool = True,
    keep_greedy: bool = False,
    trace: Callable[[BeamStep], None] | None = None,
    compile: bool = False,
) -> BeamSearchResult:
    """Beam search over the KV cache: every source's ``beam_size`` beams in one (b * beam) batch.

    Defaults are the paper's (section 6.1): beam 4, alpha 0.6, at most source length + 50 tokens.

    * Scores: log-probabilities in float32 (``log_softmax``), summed over the hypothesis. A
      hypothesis of n tokens (eos included, bos not) is ranked by its normalized score
      ``score / lp(n)`` with GNMT's ``lp(n) = ((5 + n) / 6) ** alpha``; alpha 0 ranks by the sum.
    * Length: at most ``floor(max_len_a * src_len + max_len_b)`` tokens, eos included, with
      src_len the source's real (unpadded) tokens, capped by the model's max_seq_len. A beam still
      open at its limit is finished there without eos. ``min_len``: eos is forbidden while fewer
      than ``min_len`` tokens precede it. The model's pad_id is never a candidate (unless
      ``mask_pad=False``).
    * Each step (fairseq / Hugging Face bookkeeping): the 2 * beam best continuations of the
      source's beams are ranked by sum score; an eos continuation ranked within the first ``beam``
      finishes (it is scored with the length penalty now and joins the source's ``beam`` best
      finished hypotheses); the first ``beam`` non-eos continuations are the next beams. So beam 1
      is greedy decoding.
    * Stopping rule, per source: with ``early_stopping=False`` (default; Hugging Face's "never")
      a source stops once its ``beam`` finished hypotheses cannot be beaten: the worst of them
      scores >= an upper bound of any future hypothesis, best_open_sum / lp(n) with n the limit
      for alpha > 0, n the next length for alpha < 0 (log-probs are <= 0, so sums only fall);
      with ``early_stopping=True`` (fairseq, Hugging Face's True) as soon as it has ``beam``
      finished hypotheses. A source also stops at its length limit or when no beam is open.
      Finished sources leave the batch (``KVCache.reorder``).

    The encoder and the cross-attention keys/values run once per source (first step at batch b),
    then the cache is expanded to b * beam rows.

    ``model`` may be an ``Ensemble`` (``aiayn.generate.ensemble``): every member's encoder and
    cache, one search over the log_softmax of the members' mean log-probabilities.

    ``keep_greedy``: beam search may prune the greedy path and end with a lower normalized score
    than greedy decoding (a search error; the tests record one at beam 2). With ``keep_greedy`` the
    greedy hypothesis (one greedy pass, about 1/beam of the search's work) joins each source's
    finished hypotheses before they are ranked, so the best returned normalized score is never
    below greedy's. A greedy hypothesis the search could not have produced (pad, or eos before
    ``min_len``) is not added.

    ``trace``: called with a ``BeamStep`` after every step (every candidate, where it went, which
    were pruned): what ``aiayn explore`` draws the search tree from. It changes nothing in the
    search, and costs nothing when None.

    ``compile``: the steps after the first run through the compiled decode step (float cache, eval
    mode; the first call of a model and shape compiles, seconds to a minute) over static shapes:
    stopped sources stay in the batch, masked, and the cache follows the beams in place. The same
    hypotheses as the eager search, their scores equal up to float rounding. Not with ``trace``.

    Returns the best hypothesis per source and up to ``n_best`` (<= beam_size) per source.
    """
    _check_search(beam_size, n_best, compile=compile, trace=trace)
    pad_id = model.config.pad_id if mask_pad else None
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
    mask_pad: bool = True,
    trace: Callable[[BeamStep], None] | None = None,
    compile: bool = False,
) -> BeamSearchResult:
    """Beam search continuing each row of ``prompt`` (b, t) with a decoder-only model, over the KV
    cache: ``beam_search_encoder_decoder``'s rules (scores, GNMT length penalty, candidates, the
    stopping rule, ``trace``) for the new tokens, the prompt run once and its cache expanded to
    the beams. At most ``max_new_tokens`` new tokens (eos included), within the model's context.

    ``prompt_valid`` (b, t) bool: rows may be left-padded (default: the model's rule, as in
    ``stream_decoder_only``); padding changes nothing. Hypotheses hold the new tokens only.
    ``eos_id`` None: a model without an end-of-text token (a character-level one): every hypothesis
    runs to the limit (``min_len`` is moot; after a hypothesis ``tokens`` holds pad_id, else 0).
    ``compile``: the steps after the prompt through the compiled decode step, as in
    ``beam_search_encoder_decoder``.
    """
    _check_search(beam_size, n_best, compile=compile, trace=trace)
    b, t = prompt.shape
    if max_new_tokens < 1 or t + max_new_tokens > model.config.max_seq_len:
        raise ValueError(f"prompt of {t} tokens + {max_new_tokens} new tokens must fit the model's context of "
                         f"{model.config.max_seq_len} (and max_new_tokens >= 1)")
    valid = prompt_validity(model, prompt, prompt_valid)  # (b, t)
    pad_id = model.config.pad_id if mask_pad else None
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
    """The search both architectures share: ``logits`` (b, v) of the first new token, ``cache``
    holding b rows (expanded here to b * k), ``limits`` (b,) most new tokens per source;
    ``step(tokens (m, 1), rows (m,), dropped)`` feeds the kept beams' tokens (after the loop has
    reordered the cache to their parent ``rows``; ``dropped``: a source left) -> logits (m, v).

    ``static``: the batch keeps all b * k rows to the end, for a compiled step's fixed shapes (and
    on a GPU, ``aiayn.generate.static_search``, for a search without a host-device sync per step). A
    source that stops has its open beams' scores set to -inf: its candidates are then all -inf, so
    its finished hypotheses stay as they are (``Finished.merge`` keeps the old ones first on
    ties) and it counts as stopped at every later step; its rows run on, unread. The cache follows
    the beams in its own buffers (``reorder_rows_in_place``), and the only read of the device per
    step is whether every source has stopped (on a GPU read a step late: ``DoneCheck``)."""
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

    # "Has every source stopped?": the static search reads it a step late on a GPU (no sync per
    # step; ``DoneCheck``), since one step past every source's stop merges only -inf candidates.
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
        elif bool(done.all()):
            break
        if static:
            beams.scores.masked_fill_(done[:, None], NEG_INF)  # a stopped source proposes nothing more
            rows = (torch.arange(n, device=device)[:, None] * k + next_beam).reshape(-1)  # (n * k,) parents
            follow_in_place(cache, rows)
            lprobs = torch.log_softmax(step(next_tok.reshape(-1, 1), rows, False).float(), dim=-1).view(n, k, v)
            continue

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
    """Insert each source's greedy hypothesis into its sorted finished hypotheses (in place), unless
    it is already there or ranks below all of them."""
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
