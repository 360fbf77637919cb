"""Beam search's hypotheses: what it returns and shows an observer, and its state (open ``Beams``,
each source's ``Finished`` best, one step's ``choose``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


def gnmt_length_penalty(length: Tensor, alpha: float) -> Tensor:
    """GNMT's length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al. 2016, eq. 14)."""
    return ((5.0 + length.float()) / 6.0) ** alpha


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


@dataclass(frozen=True)
class BeamStep:
    """One step of the search (``trace=``): the 2 * beam candidates of every source still searching,
    best first. Per source (n,): sources, at_limit, done; per candidate (n, c): ``parent`` beam slot,
    ``token``, sum ``score`` (-inf: none), ``finished``, ``slot`` next (-1: pruned or finished)."""

    t: int
    sources: Tensor
    parent: Tensor
    token: Tensor
    score: Tensor
    finished: Tensor
    slot: Tensor
    at_limit: Tensor
    done: Tensor


@dataclass
class Beams:
    """The open hypotheses of the n sources still searching, k per source, best first."""

    scores: Tensor  # (n, k) sum of log-probabilities; -inf = no hypothesis in this slot
    tokens: Tensor  # (n, k, L) ids so far, L = the longest limit; fill id after the last
    token_scores: Tensor  # (n, k, L) float32 log-probability of each token

    def extend(self, t: int, parent: Tensor, token: Tensor, token_lp: Tensor) -> tuple[Tensor, Tensor]:
        """The parents' (n, m) histories with ``token``, ``token_lp`` at slot t - 1 -> (n, m, L) each."""
        idx = parent[:, :, None].expand(-1, -1, self.tokens.shape[2])  # (n, m, L)
        new_tokens, new_scores = self.tokens.gather(1, idx), self.token_scores.gather(1, idx)
        new_tokens[:, :, t - 1], new_scores[:, :, t - 1] = token, token_lp
        return new_tokens, new_scores

    def select(self, sources: Tensor) -> Beams:
        """The beams of the sources at local ids ``sources`` (n_new,)."""
        return Beams(self.scores[sources], self.tokens[sources], self.token_scores[sources])


@dataclass
class Finished:
    """The k best finished hypotheses of every source, best first; -inf normalized score: empty slot."""

    norm: Tensor  # (b, k) score / gnmt_length_penalty(length, alpha): the ranking
    score: Tensor  # (b, k) sum of log-probabilities
    length: Tensor  # (b, k) long, eos included
    tokens: Tensor  # (b, k, L) ids, fill id after the hypothesis
    token_scores: Tensor  # (b, k, L) log-probability of each token

    @classmethod
    def empty(cls, b: int, k: int, n_max: int, fill_id: int, device: torch.device) -> Finished:
        return cls(norm=torch.full((b, k), NEG_INF, device=device),
                   score=torch.full((b, k), NEG_INF, device=device),
                   length=torch.zeros(b, k, dtype=torch.long, device=device),
                   tokens=torch.full((b, k, n_max), fill_id, dtype=torch.long, device=device),
                   token_scores=torch.zeros(b, k, n_max, device=device))

    def merge(self, alive: Tensor, score: Tensor, length: Tensor, tokens: Tensor, token_scores: Tensor,
              alpha: float) -> None:
        """Merge candidates (n, c) (-inf: none) into the k best of the sources ``alive``; old ones win ties."""
        k, n_max = self.norm.shape[1], self.tokens.shape[2]
        all_score = torch.cat([self.score[alive], score], dim=1)  # (n, k + c)
        all_len = torch.cat([self.length[alive], length], dim=1)
        all_norm = torch.where(torch.isfinite(all_score), all_score / gnmt_length_penalty(all_len, alpha),
                               NEG_INF)
        best = torch.sort(all_norm, dim=1, descending=True, stable=True).indices[:, :k]  # (n, k)
        self.norm[alive] = all_norm.gather(1, best)
        self.score[alive] = all_score.gather(1, best)
        self.length[alive] = all_len.gather(1, best)
        idx = best[:, :, None].expand(-1, -1, n_max)  # (n, k, L)
        self.tokens[alive] = torch.cat([self.tokens[alive], tokens], 1).gather(1, idx)
        self.token_scores[alive] = torch.cat([self.token_scores[alive], token_scores], 1).gather(1, idx)

    def insert(self, i: int, slot: int, *, norm: float, score: float, tokens: Tensor, token_scores: Tensor,
               fill_id: int) -> None:
        """Put a hypothesis at rank ``slot`` of source i, moving the ones below down (the last drops out)."""
        n = tokens.shape[0]
        for buf in (self.norm, self.score, self.length, self.tokens, self.token_scores):
            buf[i, slot + 1:] = buf[i, slot:-1].clone()
        self.norm[i, slot], self.score[i, slot], self.length[i, slot] = norm, score, n
        self.tokens[i, slot], self.token_scores[i, slot] = fill_id, 0.0
        self.tokens[i, slot, :n], self.token_scores[i, slot, :n] = tokens, token_scores

    def result(self, n_best: int) -> BeamSearchResult:
        """The best hypothesis of every source and its ``n_best`` list."""
        lengths, scores, norms = self.length[:, 0].clone(), self.score[:, 0].clone(), self.norm[:, 0].clone()
        width = int(lengths.max())
        nbest = [
            [Hypothesis(tokens=self.tokens[i, j, : self.length[i, j]].clone(), score=float(self.score[i, j]),
                        normalized_score=float(self.norm[i, j]),
                        token_scores=self.token_scores[i, j, : self.length[i, j]].clone())
             for j in range(n_best) if torch.isfinite(self.norm[i, j])]
            for i in range(self.norm.shape[0])
        ]
        return BeamSearchResult(tokens=self.tokens[:, 0, :width].clone(), lengths=lengths, scores=scores,
                                normalized_scores=norms, nbest=nbest)


@dataclass
class Choice:
    """One step's 2k best continuations per source, (n, 2k) each, best first, and what became of them."""

    top_scores: Tensor  # sum scores
    top_beam: Tensor  # the parent beam
    top_tok: Tensor  # the token
    eos_ok: Tensor  # (n, k) the eos continuations ranked within the first k: finished now
    keep: Tensor  # (n, k) the candidates that are the next beams
    next_beam: Tensor  # (n, k)
    next_tok: Tensor  # (n, k)
    at_limit: Tensor  # (n,) sources at their length limit
    done: Tensor  # (n,) sources that stop searching after this step


def choose(t: int, beams: Beams, finished: Finished, lprobs: Tensor, alive: Tensor, limits: Tensor, *, k: int,
            eos_id: int, pad_id: int | None, min_len: int, alpha: float,
            early_stopping: bool) -> tuple[Beams, Choice]:
    """Step t of the search over the open beams' log-probs (n, k, v): the next beams; finished ones merged."""
    n, v, device = alive.shape[0], lprobs.shape[-1], alive.device
    if pad_id is not None:
        lprobs[:, :, pad_id] = NEG_INF
    if t - 1 < min_len:
        lprobs[:, :, eos_id] = NEG_INF
    # The 2k best continuations of each source's beams, by sum score, best first: (n, 2k) each.
    n_cand = min(2 * k, k * v)
    cand = (beams.scores[:, :, None] + lprobs).view(n, k * v)  # (n, k * v) sum scores
    top_scores, top_idx = cand.topk(n_cand, dim=1)
    top_beam, top_tok = top_idx // v, top_idx % v  # the parent beam and the token
    top_lp = lprobs.view(n, k * v).gather(1, top_idx)  # this token's own log-prob
    is_eos = top_tok == eos_id

    # Finished now: eos continuations ranked within the first k.
    eos_ok = is_eos[:, :k] & torch.isfinite(top_scores[:, :k])  # (n, k)
    eos_tokens, eos_token_scores = beams.extend(t, top_beam[:, :k], top_tok[:, :k], top_lp[:, :k])
    eos_score = torch.where(eos_ok, top_scores[:, :k], NEG_INF)  # (n, k)

    # Next beams: the first k non-eos continuations (stable sort keeps the rank order).
    keep = torch.sort(is_eos.to(torch.uint8), dim=1, stable=True).indices[:, :k]  # (n, k)
    next_beam, next_tok = top_beam.gather(1, keep), top_tok.gather(1, keep)  # (n, k)
    next_tokens, next_token_scores = beams.extend(t, next_beam, next_tok, top_lp.gather(1, keep))
    beams = Beams(top_scores.gather(1, keep), next_tokens, next_token_scores)  # scores best first

    # At its length limit a source's open beams finish too (without eos).
    at_limit = t >= limits[alive]  # (n,)
    open_score = torch.where(at_limit[:, None], beams.scores, NEG_INF)  # (n, k)

    # Into the source's k best finished hypotheses (old ones first on ties): (n, 2k) candidates.
    length_t = torch.full((n, k), t, dtype=torch.long, device=device)
    finished.merge(alive, torch.cat([eos_score, open_score], 1), torch.cat([length_t, length_t], 1),
                   torch.cat([eos_tokens, beams.tokens], 1),
                   torch.cat([eos_token_scores, beams.token_scores], 1), alpha)

    done = sources_done(finished.norm[alive][:, k - 1], beams.scores[:, 0], limits[alive], t=t,
                         alpha=alpha, early_stopping=early_stopping) | at_limit  # (n,)
    return beams, Choice(top_scores, top_beam, top_tok, eos_ok, keep, next_beam, next_tok, at_limit, done)


def trace_step(trace: Callable[[BeamStep], None], t: int, alive: Tensor, c: Choice, k: int) -> None:
    n = alive.shape[0]
    slot = torch.full_like(c.top_tok, -1).scatter_(
        1, c.keep, torch.arange(k, device=alive.device).expand(n, k).contiguous())  # (n, 2k)
    trace(BeamStep(t=t, sources=alive.clone(), parent=c.top_beam, token=c.top_tok, score=c.top_scores,
                   finished=torch.cat([c.eos_ok, torch.zeros_like(c.top_tok[:, k:], dtype=torch.bool)], 1),
                   slot=slot, at_limit=c.at_limit, done=c.done))


def sources_done(worst_finished: Tensor, best_open: Tensor, limits: Tensor, *, t: int, alpha: float,
                  early_stopping: bool) -> Tensor:
    """(n,) bool: the sources that stop after step t, from the k-th finished normalized score and the best
    open sum score (the length limit aside)."""
    if early_stopping:
        done = torch.isfinite(worst_finished)
    else:
        # The best any continuation of the best open beam can score (log-probs <= 0).
        bound_len = limits if alpha > 0 else torch.full_like(limits, t + 1)
        bound = best_open / gnmt_length_penalty(bound_len, alpha) if alpha != 0 else best_open
        done = worst_finished >= bound
    return done | ~torch.isfinite(best_open)
