"""Decoding over the KV cache: greedy, and sampling with temperature / top-k / top-p.

Each greedy function can run with ``use_cache=False``, recomputing the whole sequence every step:
the reference the cached path is tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.fast.compiled_decode import cache_len as _cache_len
from aiayn.fast.compiled_decode import compiled_decode_step
from aiayn.models.decoder_only import DecoderOnly
from aiayn.models.encoder_decoder import EncoderDecoder
from aiayn.nn.kv_cache import KVCache


class GreedyResult:
    """What a greedy decoder returns.

    tokens (b, n_new): the generated ids (after eos: pad_id, or eos repeated if no pad_id).
    logits (b, n_new, v): the logits each token was chosen from, stacked from the per-step logits
        on first access (a copy of b x n_new x v floats, 131 MB for 16 x 256 x 8,000, that a caller
        wanting only the tokens never pays).
    lengths (b,) or None: tokens generated per row, eos included (encoder-decoder).
    """

    def __init__(self, tokens: Tensor, step_logits: list[Tensor], lengths: Tensor | None = None) -> None:
        self.tokens, self.lengths = tokens, lengths
        self._step_logits = step_logits  # n_new x (b, v)

    @functools.cached_property
    def logits(self) -> Tensor:
        return torch.stack(self._step_logits, 1)


def _finish(next_token: Tensor, done: Tensor, eos_id: int | None, fill_id: int | None) -> tuple[Tensor, Tensor]:
    if eos_id is None:
        return next_token, done
    if fill_id is not None:
        next_token = torch.where(done, torch.full_like(next_token, fill_id), next_token)
    return next_token, done | (next_token == eos_id)


@torch.inference_mode()
def greedy_decoder_only(
    model: DecoderOnly,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    prompt_valid: Tensor | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    kv_cache: str | None = None,
    compile: bool = False,
) -> GreedyResult:
    """Continue each row of ``prompt`` (b, t), left-padded where ``prompt_valid`` is False.

    ``kv_cache="int8"``/``"int4"`` decodes over a quantised KV cache (float by default).
    ``compile=True`` runs the steps after the prompt through ``compiled_decode_step``.

    Without ``prompt_valid`` the model's default applies: ``prompt != pad_id`` when the config has
    a pad_id, else every prompt token is real. Generated tokens always count as real.
    """
    b, t = prompt.shape
    if prompt_valid is not None:
        valid = prompt_valid
    elif model.config.pad_id is not None:  # the model's own default: pad ids are padding
        valid = prompt != model.config.pad_id
    else:
        valid = torch.ones_like(prompt, dtype=torch.bool)
    if compile and not use_cache:
        raise ValueError("compile=True decodes through the KV cache; it needs use_cache=True")
    cache = model.new_cache(b, _cache_len(t + max_new_tokens, compile), quantize=kv_cache) if use_cache else None
    tokens, step_valid = prompt, valid
    all_tokens, all_valid = prompt, valid
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    out_tokens, out_logits = [], []
    for i in range(max_new_tokens):
        if cache is not None and compile and i > 0:
            logits = compiled_decode_step(model, tokens, cache)
        elif cache is not None:
            logits = model(tokens, valid=step_valid, cache=cache).logits[:, -1]
        else:
            logits = model(all_tokens, valid=all_valid).logits[:, -1]
        next_token, done_now = _finish(logits.argmax(-1), done, eos_id, model.config.pad_id)
        out_tokens.append(next_token)
        out_logits.append(logits)
        tokens, step_valid = next_token[:, None], torch.ones(b, 1, dtype=torch.bool, device=prompt.device)
        if cache is None:  # recomputing: the whole sequence so far is the next input
            all_tokens = torch.cat([all_tokens, tokens], dim=1)
            all_valid = torch.cat([all_valid, step_valid], dim=1)
        done = done_now
        if bool(done.all()):
            break
    return GreedyResult(torch.stack(out_tokens, 1), out_logits)


@torch.inference_mode()
def greedy_encoder_decoder(
    model: EncoderDecoder,
    src: Tensor,
    *,
    bos_id: int,
    max_new_tokens: int | Tensor,
    src_valid: Tensor | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> GreedyResult:
    """Translate each row of ``src`` (b, s) greedily, starting every target with ``bos_id``.

    ``max_new_tokens`` is one limit for all rows or a (b,) tensor of per-source limits (e.g.
    ``max_target_lengths``); a row past its limit holds pad_id (eos_id if the model has no pad_id)
    and ``lengths`` says how many tokens each row generated (up to and including eos).
    """
    b = src.shape[0]
    limit = torch.as_tensor(max_new_tokens, device=src.device).expand(b)  # (b,)
    n_steps = int(limit.max())
    fill_id = model.config.pad_id if model.config.pad_id is not None else eos_id
    encoded = model.encode(src, src_valid=src_valid)  # computed once per source
    cache = model.new_cache(b, n_steps + 1) if use_cache else None
    tgt = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)
    step = tgt
    done = torch.zeros(b, dtype=torch.bool, device=src.device)
    lengths = torch.zeros(b, dtype=torch.long, device=src.device)
    out_tokens, out_logits = [], []
    for i in range(n_steps):
        if cache is not None:
            logits = model.decode(step, encoded, tgt_valid=torch.ones_like(step, dtype=torch.bool),
                                  cache=cache).logits[:, -1]
        else:  # generated tokens are real even if one equals pad_id
            logits = model.decode(tgt, encoded, tgt_valid=torch.ones_like(tgt, dtype=torch.bool)).logits[:, -1]
        next_token, done_now = _finish(logits.argmax(-1), done, eos_id, model.config.pad_id)
        over = i >= limit  # (b,) rows past their own limit
        if fill_id is not None:
            next_token = torch.where(over, torch.full_like(next_token, fill_id), next_token)
        lengths += ~(done | over)
        out_tokens.append(next_token)
        out_logits.append(logits)
        step = next_token[:, None]
        tgt = torch.cat([tgt, step], dim=1)
        done = done_now | (i + 1 >= limit)
        if bool(done.all()):
            break
    return GreedyResult(torch.stack(out_tokens, 1), out_logits, lengths)


@dataclass
class SamplingConfig:
    """How the next token is drawn. temperature 0 = greedy (argmax)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")


def apply_repetition_penalty(logits: Tensor, previous: Tensor, penalty: float) -> Tensor:
    """CTRL's penalty: logits of tokens already present are divided (if > 0) or multiplied by it.

    logits (b, v), previous (b, t) token ids -> (b, v)
    """
    if penalty == 1.0:
        return logits
    seen = torch.gather(logits, 1, previous)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(1, previous, seen)


def filter_logits(logits: Tensor, *, top_k: int | None, top_p: float | None) -> Tensor:
    """Keep the top-k logits and/or the smallest set whose probability reaches top_p; -inf elsewhere."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token if the tokens ranked above it already reach top_p (the first always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: Tensor, previous: Tensor, cfg: SamplingConfig,
                generator: torch.Generator | None = None) -> Tensor:
    """logits (b, v) of the next token, previous (b, t) ids -> next ids (b,)"""
    logits = apply_repetition_penalty(logits.float(), previous, cfg.repetition_penalty)
    if cfg.temperature == 0:
        return logits.argmax(-1)
    logits = filter_logits(logits / cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _prompt_valid(model: DecoderOnly, prompt: Tensor, prompt_valid: Tensor | None) -> Tensor:
    """(b, t) bool: ``prompt_valid``, else the model's default (``prompt != pad_id`` or all True)."""
    if prompt_valid is not None:
        if prompt_valid.shape != prompt.shape or prompt_valid.dtype != torch.bool:
            raise ValueError(f"prompt_valid must be a bool tensor of the prompt's shape {tuple(prompt.shape)}, "
                             f"got {prompt_valid.dtype} {tuple(prompt_valid.shape)}")
        if not bool(prompt_valid.any(dim=1).all()):
            raise ValueError("a prompt row has no real token (prompt_valid all False); drop it or give a token")
        return prompt_valid
    if model.config.pad_id is not None:
        return prompt != model.config.pad_id
    return torch.ones_like(prompt, dtype=torch.bool)


@torch.inference_mode()
def generate_decoder_only(
    model: DecoderOnly,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    prompt_valid: Tensor | None = None,
    eos_id: int | None = None,
    on_token: Callable[[Tensor], bool | None] | None = None,
    kv_cache: str | None = None,
    compile: bool = False,
) -> Tensor:
    """Sample a continuation of ``prompt`` (b, t) through the KV cache -> new ids (b, n <= max_new_tokens).

    Rows may be left-padded: ``prompt_valid`` (b, t) bool marks the real tokens (default: the
    model's, ``prompt != pad_id`` when the config has a pad_id). Padding changes nothing: each row
    gets the tokens it would get alone (greedy), since padded keys are masked and positions count
    real tokens only. Generated tokens always count as real. ``on_token`` receives each step's
    (b,) ids as they are produced (for streaming); returning True stops early (e.g. a stop string).

    The loop allocates once: the KV cache and a (b, t + max_new_tokens) id buffer for the
    repetition penalty; each step runs the model on one token per row and the output projection
    on that position only. ``kv_cache="int8"``/``"int4"``:
    a quantised cache. ``compile=True``: the steps after the prompt run through
    ``compiled_decode_step`` (float cache only).
    """
    cfg = sampling or SamplingConfig()
    generator = torch.Generator(device=prompt.device).manual_seed(cfg.seed) if cfg.seed is not None else None
    b, t = prompt.shape
    max_len = model.config.max_seq_len
    if t + max_new_tokens > max_len:
        raise ValueError(f"prompt of {t} tokens + {max_new_tokens} new tokens exceeds the model's context "
                         f"of {max_len}; shorten the prompt or ask for fewer tokens")
    valid = _prompt_valid(model, prompt, prompt_valid)
    if compile and kv_cache is not None:
        raise ValueError("compiled decoding needs a float KV cache; drop compile or the cache quantisation")
    cache = model.new_cache(b, _cache_len(t + max_new_tokens, compile), quantize=kv_cache)
    # Ids seen so far, for the repetition penalty; a pad slot repeats its row's last prompt token,
    # so padding penalises nothing extra.
    history = torch.empty(b, t + max_new_tokens, dtype=prompt.dtype, device=prompt.device)
    history[:, :t] = torch.where(valid, prompt, prompt[:, -1:])
    step_valid = torch.ones(b, 1, dtype=torch.bool, device=prompt.device)
    logits = _last_logits(model, prompt, valid, cache)
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    generated = []
    for i in range(max_new_tokens):
        next_token = sample_next(logits, history[:, : t + i], cfg, generator)
        if eos_id is not None:
            next_token = torch.where(done, torch.full_like(next_token, eos_id), next_token)
            done = done | (next_token == eos_id)
        generated.append(next_token)
        history[:, t + i] = next_token
        if on_token is not None and on_token(next_token):
            break
        if i == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
            break
        if compile:
            logits = compiled_decode_step(model, next_token[:, None], cache)
        else:
            logits = _last_logits(model, next_token[:, None], step_valid, cache)
    return torch.stack(generated, dim=1)


def _last_logits(model: DecoderOnly, tokens: Tensor, valid: Tensor, cache: KVCache) -> Tensor:
    """Run ``tokens`` (b, t) through the model into ``cache``; logits (b, v) of the last position
    only (the output projection is the largest matmul of a small model's decode step)."""
    hidden = model.decoder(tokens, valid=valid, cache=cache).hidden  # (b, t, d)
    return model.lm_head(hidden[:, -1])


# ---- encoder-decoder: per-source length limits, sampling, beam search ----------------------------
def max_target_lengths(src_valid: Tensor, *, max_len_a: float, max_len_b: int,
                       cap: int | None = None) -> Tensor:
    """(b,) most target tokens per source, eos included (fairseq's convention):
    floor(max_len_a * real source tokens + max_len_b), at least 1 and at most ``cap``."""
    src_len = src_valid.sum(dim=1).double()  # (b,) padding does not count
    limit = torch.floor(max_len_a * src_len + max_len_b).long().clamp(min=1)
    return limit if cap is None else limit.clamp(max=cap)


def _decode_cached_step(model: EncoderDecoder, tokens: Tensor, memory_valid: Tensor,
                        cache: KVCache) -> Tensor:
    """Next-token logits (b, v) for tokens (b, 1) continuing ``cache``, whose cross-attention keys
    and values are already filled: the encoder memory itself is not needed again, only its
    validity (b, s) for the cross-attention mask."""
    out = model.decoder(tokens, valid=torch.ones_like(tokens, dtype=torch.bool), memory=None,
                        memory_valid=memory_valid, cache=cache)
    return model.lm_head(out.hidden[:, -1])


@torch.inference_mode()
def sample_encoder_decoder(
    model: EncoderDecoder,
    src: Tensor,
    *,
    bos_id: int,
    max_new_tokens: int | Tensor,
    sampling: SamplingConfig | None = None,
    src_valid: Tensor | None = None,
    eos_id: int | None = None,
) -> Tensor:
    """Sample a target for each row of ``src`` (b, s) through the KV cache -> ids (b, n).

    Temperature / top-k / top-p / repetition penalty as in ``SamplingConfig`` (temperature 0 =
    greedy); the repetition penalty sees the target so far, bos included. ``max_new_tokens``: one
    limit or (b,) per-source limits. After a row's eos or its limit the row holds pad_id (eos_id
    if the model has no pad_id).
    """
    cfg = sampling or SamplingConfig()
    generator = torch.Generator(device=src.device).manual_seed(cfg.seed) if cfg.seed is not None else None
    b = src.shape[0]
    limit = torch.as_tensor(max_new_tokens, device=src.device).expand(b)  # (b,)
    n_steps = int(limit.max())
    fill_id = model.config.pad_id if model.config.pad_id is not None else eos_id
    encoded = model.encode(src, src_valid=src_valid)
    cache = model.new_cache(b, n_steps)
    history = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)  # (b, 1 + i)
    logits = model.decode(history, encoded, tgt_valid=torch.ones_like(history, dtype=torch.bool),
                          cache=cache).logits[:, -1]  # (b, v); fills the cross-attention cache
    done = torch.zeros(b, dtype=torch.bool, device=src.device)
    generated = []
    for i in range(n_steps):
        next_token = sample_next(logits, history, cfg, generator)  # (b,)
        if fill_id is not None:
            next_token = torch.where(done, torch.full_like(next_token, fill_id), next_token)
        generated.append(next_token)
        history = torch.cat([history, next_token[:, None]], dim=1)
        if eos_id is not None:
            done = done | (next_token == eos_id)
        done = done | (i + 1 >= limit)
        if bool(done.all()):
            break
        logits = _decode_cached_step(model, next_token[:, None], encoded.valid, cache)
    return torch.stack(generated, dim=1)


def gnmt_length_penalty(length: Tensor, alpha: float) -> Tensor:
    """GNMT's length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al. 2016, eq. 14)."""
    return ((5.0 + length.float()) / 6.0) ** alpha


def _extend(tokens: Tensor, token_scores: Tensor, t: int, parent: Tensor, tok: Tensor,
            lp: Tensor) -> tuple[Tensor, Tensor]:
    """Histories (n, k, L) of the chosen parents (n, m), with token ``tok`` (n, m) and its log-prob
    ``lp`` at slot t - 1 -> new histories (n, m, L) of ids and of log-probs."""
    idx = parent[:, :, None].expand(-1, -1, tokens.shape[2])
    new_tokens, new_scores = tokens.gather(1, idx), token_scores.gather(1, idx)
    new_tokens[:, :, t - 1], new_scores[:, :, t - 1] = tok, lp
    return new_tokens, new_scores


@dataclass
class Hypothesis:
    tokens: Tensor  # (n,) ids without bos; ends with eos unless the length limit was reached
    score: float  # sum of the tokens' log-probabilities
    normalized_score: float  # score / gnmt_length_penalty(n, alpha): what the search ranks by
    token_scores: Tensor  # (n,) float32 log-probability of each token


@dataclass
class BeamSearchResult:
    """The best hypothesis per source, padded into one tensor, and the n-best lists."""

    tokens: Tensor  # (b, n) best hypothesis per source (no bos, eos included); then pad_id (or eos)
    lengths: Tensor  # (b,) tokens in each best hypothesis, eos included
    scores: Tensor  # (b,) float32 sum of log-probabilities of the best hypothesis
    normalized_scores: Tensor  # (b,) scores / gnmt_length_penalty(lengths, alpha)
    nbest: list[list[Hypothesis]]  # per source: up to n_best hypotheses, best first

    def token_lists(self, *, eos_id: int | None = None) -> list[list[int]]:
        """Best hypotheses as Python lists, without the trailing eos when eos_id is given."""
        out = []
        for row, n in zip(self.tokens.tolist(), self.lengths.tolist(), strict=True):
            row = row[:n]
            out.append(row[:-1] if eos_id is not None and row and row[-1] == eos_id else row)
        return out


@torch.inference_mode()
def beam_search_encoder_decoder(
    model: EncoderDecoder,
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

    ``keep_greedy``: beam search may prune the greedy path and end with a lower normalized score
    than greedy decoding (a search error; the tests record one at beam 2). With ``keep_greedy`` the
    greedy hypothesis (one greedy pass, about 1/beam of the search's work) joins each source's
    finished hypotheses before they are ranked, so the best returned normalized score is never
    below greedy's. A greedy hypothesis the search could not have produced (pad, or eos before
    ``min_len``) is not added.

    Returns the best hypothesis per source and up to ``n_best`` (<= beam_size) per source.
    """
    if beam_size < 1 or not 1 <= n_best <= beam_size:
        raise ValueError(f"need beam_size >= 1 and 1 <= n_best <= beam_size, got beam_size={beam_size}, "
                         f"n_best={n_best}")
    pad_id = model.config.pad_id if mask_pad else None
    fill_id = pad_id if pad_id is not None else eos_id
    device, b, k = src.device, src.shape[0], beam_size
    alpha = length_penalty

    encoded = model.encode(src, src_valid=src_valid)  # once per source: memory (b, s, d)
    limits = max_target_lengths(encoded.valid, max_len_a=max_len_a, max_len_b=max_len_b,
                                cap=model.config.max_seq_len)  # (b,)
    n_max = int(limits.max())
    cache = model.new_cache(b, n_max)  # bos + at most n_max - 1 fed tokens
    bos = torch.full((b, 1), bos_id, dtype=torch.long, device=device)
    logits = model.decode(bos, encoded, tgt_valid=torch.ones_like(bos, dtype=torch.bool),
                          cache=cache).logits[:, -1]  # (b, v); fills the cross-attention k/v once
    v = logits.shape[-1]
    cache.repeat_interleave(k)  # (b * k) rows: source i's beams are rows i*k .. i*k + k-1
    lprobs = torch.log_softmax(logits.float(), dim=-1).repeat_interleave(k, dim=0).view(b, k, v)

    # Open beams of the sources still searching (n of them; `alive` maps them to source ids).
    alive = torch.arange(b, device=device)  # (n,)
    beam_scores = torch.full((b, k), float("-inf"), device=device)  # (n, k) sum log-prob
    beam_scores[:, 0] = 0.0  # at the first step only beam 0 is real (all beams are equal)
    beam_tokens = torch.full((b, k, n_max), fill_id, dtype=torch.long, device=device)  # (n, k, L)
    beam_token_scores = torch.zeros(b, k, n_max, device=device)  # (n, k, L)
    memory_valid = encoded.valid.repeat_interleave(k, dim=0)  # (n * k, s)

    # Finished hypotheses of every source, best first: normalized score -inf = empty slot.
    fin_norm = torch.full((b, k), float("-inf"), device=device)  # (b, k)
    fin_score = torch.full((b, k), float("-inf"), device=device)
    fin_len = torch.zeros(b, k, dtype=torch.long, device=device)
    fin_tokens = torch.full((b, k, n_max), fill_id, dtype=torch.long, device=device)  # (b, k, L)
    fin_token_scores = torch.zeros(b, k, n_max, device=device)

    n_cand = min(2 * k, k * v)
    for t in range(1, n_max + 1):  # t: length of the hypotheses after this step
        n = alive.shape[0]
        if pad_id is not None:
            lprobs[:, :, pad_id] = float("-inf")
        if t - 1 < min_len:
            lprobs[:, :, eos_id] = float("-inf")
        cand = (beam_scores[:, :, None] + lprobs).view(n, k * v)  # (n, k * v) sum scores
        top_scores, top_idx = cand.topk(n_cand, dim=1)  # (n, 2k), best first
        top_beam, top_tok = top_idx // v, top_idx % v  # (n, 2k)
        top_lp = lprobs.view(n, k * v).gather(1, top_idx)  # (n, 2k) this token's log-prob
        is_eos = top_tok == eos_id

        # Finished now: eos continuations ranked within the first k.
        eos_ok = is_eos[:, :k] & torch.isfinite(top_scores[:, :k])  # (n, k)
        eos_toks, eos_tscores = _extend(beam_tokens, beam_token_scores, t, top_beam[:, :k],
                                        top_tok[:, :k], top_lp[:, :k])  # (n, k, L)
        eos_score = torch.where(eos_ok, top_scores[:, :k], float("-inf"))

        # Next beams: the first k non-eos continuations (stable sort keeps the rank order).
        keep = torch.sort(is_eos.to(torch.uint8), dim=1, stable=True).indices[:, :k]  # (n, k)
        next_scores = top_scores.gather(1, keep)  # (n, k), best first
        next_beam, next_tok = top_beam.gather(1, keep), top_tok.gather(1, keep)
        beam_tokens, beam_token_scores = _extend(beam_tokens, beam_token_scores, t, next_beam,
                                                 next_tok, top_lp.gather(1, keep))
        beam_scores = next_scores

        # At its length limit a source's open beams finish too (without eos).
        at_limit = t >= limits[alive]  # (n,)
        open_score = torch.where(at_limit[:, None], next_scores, float("-inf"))

        # Merge into the source's k best finished hypotheses (old ones first on ties).
        length_t = torch.full((n, k), t, dtype=torch.long, device=device)
        all_score = torch.cat([fin_score[alive], eos_score, open_score], dim=1)  # (n, 3k)
        all_len = torch.cat([fin_len[alive], length_t, length_t], dim=1)
        all_norm = torch.where(torch.isfinite(all_score), all_score / gnmt_length_penalty(all_len, alpha),
                               float("-inf"))
        best = torch.sort(all_norm, dim=1, descending=True, stable=True).indices[:, :k]  # (n, k)
        fin_norm[alive] = all_norm.gather(1, best)
        fin_score[alive] = all_score.gather(1, best)
        fin_len[alive] = all_len.gather(1, best)
        idx = best[:, :, None].expand(-1, -1, n_max)
        fin_tokens[alive] = torch.cat([fin_tokens[alive], eos_toks, beam_tokens], 1).gather(1, idx)
        fin_token_scores[alive] = torch.cat([fin_token_scores[alive], eos_tscores, beam_token_scores],
                                            1).gather(1, idx)

        # Which sources are done (see the docstring's stopping rule).
        best_open = next_scores[:, 0]  # (n,)
        worst_fin = fin_norm[alive][:, k - 1]  # (n,) -inf while fewer than k finished
        if early_stopping:
            done = torch.isfinite(worst_fin)
        else:
            bound_len = limits[alive] if alpha > 0 else torch.full_like(alive, t + 1)
            bound = best_open / gnmt_length_penalty(bound_len, alpha) if alpha != 0 else best_open
            done = worst_fin >= bound
        done = done | at_limit | ~torch.isfinite(best_open)
        if bool(done.all()):
            break

        # Follow the kept beams (and drop finished sources) in the cache, then feed the new tokens.
        stay = (~done).nonzero().squeeze(1)  # (n_new,) local ids of sources still searching
        rows = (stay[:, None] * k + next_beam[stay]).reshape(-1)  # (n_new * k,) parent rows
        cache.reorder(rows, cross=bool(done.any()))  # cross k/v only change when a source leaves
        if bool(done.any()):
            alive, memory_valid = alive[stay], memory_valid.index_select(0, rows)
            beam_scores, beam_tokens, beam_token_scores = (
                beam_scores[stay], beam_tokens[stay], beam_token_scores[stay])
        step_logits = _decode_cached_step(model, next_tok[stay].reshape(-1, 1), memory_valid, cache)
        lprobs = torch.log_softmax(step_logits.float(), dim=-1).view(stay.shape[0], k, v)

    if keep_greedy:
        _merge_greedy(model, src, src_valid, limits, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                      fill_id=fill_id, min_len=min_len, alpha=alpha, fin=(fin_norm, fin_score, fin_len, fin_tokens,
                                                         fin_token_scores))

    # Collect: finished hypotheses are sorted best first.
    lengths, scores, norms = fin_len[:, 0].clone(), fin_score[:, 0].clone(), fin_norm[:, 0].clone()
    width = int(lengths.max())
    tokens = fin_tokens[:, 0, :width].clone()
    nbest = [
        [Hypothesis(tokens=fin_tokens[i, j, : fin_len[i, j]].clone(), score=float(fin_score[i, j]),
                    normalized_score=float(fin_norm[i, j]),
                    token_scores=fin_token_scores[i, j, : fin_len[i, j]].clone())
         for j in range(n_best) if torch.isfinite(fin_norm[i, j])]
        for i in range(b)
    ]
    return BeamSearchResult(tokens=tokens, lengths=lengths, scores=scores, normalized_scores=norms,
                            nbest=nbest)


def _merge_greedy(model: EncoderDecoder, src: Tensor, src_valid: Tensor | None, limits: Tensor, *,
                  bos_id: int, eos_id: int, pad_id: int | None, fill_id: int, min_len: int, alpha: float,
                  fin: tuple[Tensor, Tensor, Tensor, Tensor, Tensor]) -> None:
    """Insert each source's greedy hypothesis into its sorted finished lists (in place), unless it
    is already there or ranks below all of them. ``fin``: normalized scores (b, k), scores (b, k),
    lengths (b, k), tokens (b, k, L), token log-probs (b, k, L)."""
    fin_norm, fin_score, fin_len, fin_tokens, fin_token_scores = fin
    greedy = greedy_encoder_decoder(model, src, bos_id=bos_id, eos_id=eos_id, max_new_tokens=limits,
                                    src_valid=src_valid)
    assert greedy.lengths is not None
    token_lp = torch.log_softmax(greedy.logits.float(), dim=-1).gather(2, greedy.tokens[:, :, None])[:, :, 0]
    k = fin_norm.shape[1]
    for i in range(src.shape[0]):
        n = int(greedy.lengths[i])
        tokens = greedy.tokens[i, :n]
        ids = tokens.tolist()
        if (pad_id is not None and pad_id in ids) or (eos_id in ids and ids.index(eos_id) < min_len):
            continue  # a hypothesis the search never proposes
        score = float(token_lp[i, :n].sum())
        norm = score / float(gnmt_length_penalty(torch.tensor(n), alpha))
        if norm <= float(fin_norm[i, k - 1]):
            continue  # ranks below every kept hypothesis (ties keep the search's)
        if any(int(fin_len[i, j]) == n and torch.equal(fin_tokens[i, j, :n], tokens) for j in range(k)):
            continue  # the search found it too
        slot = int((fin_norm[i] >= norm).sum())  # after the hypotheses that rank at least as high
        for buf in (fin_norm, fin_score, fin_len, fin_tokens, fin_token_scores):
            buf[i, slot + 1:] = buf[i, slot:-1].clone()
        fin_norm[i, slot], fin_score[i, slot], fin_len[i, slot] = norm, score, n
        fin_tokens[i, slot], fin_token_scores[i, slot] = fill_id, 0.0
        fin_tokens[i, slot, :n], fin_token_scores[i, slot, :n] = tokens, token_lp[i, :n]
