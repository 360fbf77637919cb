"""Generation past the model's context: the sliding window ``stream_decoder_only`` re-prefills.

When a row's next token would need position ``max_seq_len`` (the model has no embedding, or was
never trained, past it), the row keeps its last ``keep_tokens(context)`` tokens, the next one
included, and the loop runs them through the model again into its cleared KV cache, then goes on
one token per step: every token is the model's prediction from the window it follows, as if that
window were the whole prompt. Recomputing is the one rule that is right for every positional
scheme. With learned or sinusoidal positions every cached key depends on its position, which moves
with the window; RoPE's keys could be rotated and ALiBi's or T5's kept (llama.cpp's context shift
rolls its cache so), but the keys of every layer past the first still carry the dropped tokens, so
a rolled cache only approximates the window. The cost: one prefill of ``keep`` tokens every
``context - keep + 1`` new tokens.

Rows of a batch slide independently: a row slides when its own tokens fill the context (a shorter,
left-padded row later), so each row gets the tokens it would get alone. A slide re-prefills every
row (one cache for the batch), the rows that did not need it with all their tokens: the same
keys up to float rounding, and the padding compacted away.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The fraction of the context a row keeps when it slides. llama.cpp's context shift discards half
# (it rotates the cache, so a slide is cheap there); here a slide recomputes the kept tokens, so
# keeping more trades prefill work (about keep / (context - keep) prefill tokens per new token: 3 at
# 3/4, 1 at 1/2) for context: a new token sees at least 3/4 of the context (7/8 on average) instead
# of 1/2 (3/4). A prefill token costs a fraction of a decode step (one batched forward), so 3/4.
KEEP_FRACTION = 0.75


def keep_tokens(context: int) -> int:
    """Tokens a row keeps when it slides, its next token included: 3/4 of ``context``, at least 1."""
    return max(1, int(context * KEEP_FRACTION))


def slide_window(ids: Tensor, valid: Tensor, token: Tensor, real: list[int], *, context: int,
                 keep: int) -> tuple[Tensor, Tensor, list[int]]:
    """The window to re-prefill when some row's ``token`` has no position (or the loop no slot) left.

    ids, valid (b, n): the tokens fed so far and which of them are real (padding: False).
    token (b,): each row's next token, not yet fed; real: each row's real tokens, ``token`` counted.
    A row with more than ``context`` real tokens keeps its last ``keep``; the others keep all.
    -> window (b, w) with each row's kept tokens at its right end in order (left padding), its
    validity (b, w) bool, and the tokens each row kept. Padded slots hold arbitrary ids (masked).
    """
    kept = [keep if n > context else n for n in real]
    w = max(kept)
    seq = torch.cat([ids, token[:, None]], dim=1)  # (b, n + 1)
    seq_valid = torch.cat([valid, torch.ones_like(token, dtype=torch.bool)[:, None]], dim=1)  # (b, n + 1)
    # Every row's real tokens moved to its right end, in order: a stable sort puts the padding first.
    order = torch.sort(seq_valid.to(torch.int8), dim=1, stable=True).indices  # (b, n + 1)
    window = seq.gather(1, order)[:, -w:]  # (b, w)
    lengths = torch.tensor(kept, device=ids.device)  # (b,)
    window_valid = torch.arange(w, device=ids.device) >= (w - lengths)[:, None]  # (b, w)
    return window, window_valid, kept
