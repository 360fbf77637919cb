"""Generation past the model's context: a row whose next token would need position ``max_seq_len``
keeps its last ``keep_tokens(context)`` tokens, recomputed into the cleared KV cache. Recomputing is
right for every positional scheme (a rolled cache, llama.cpp's context shift, keeps the dropped
tokens in every layer past the first); rows slide independently."""

from __future__ import annotations

import torch
from torch import Tensor

# The fraction of the context a row keeps when it slides: a slide recomputes the kept tokens, so
# keeping more trades prefill work for context (llama.cpp, rotating its cache, discards half).
KEEP_FRACTION = 0.75


def keep_tokens(context: int) -> int:
    """Tokens a row keeps when it slides, its next token included: 3/4 of ``context``, at least 1."""
    return max(1, int(context * KEEP_FRACTION))


def slide_window(ids: Tensor, valid: Tensor, token: Tensor, real: list[int], *, context: int,
                 keep: int) -> tuple[Tensor, Tensor, list[int]]:
    """The window to re-prefill: ids, valid (b, n) fed so far, token (b,) the next, real each row's real
    tokens (``token`` counted). A row with more than ``context`` keeps its last ``keep``, the others all
    -> window (b, w) left-padded, its validity, and the tokens each row kept."""
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
