"""Which prompt tokens the serve engine's prefill forward feeds at a step (``aiayn.serve.engine``).

The prefilling rows share one forward of ``(k, w)`` tokens: ``k`` rows right-padded to the widest
row's ``w`` tokens. Its cost is about its area ``k * w`` (every padded position goes through the
matmuls), so ``--prefill-chunk`` bounds the area, not just the real tokens: ``prefill_plan`` picks
the rows and the width under that bound.

* **Fewest tokens left first** (shortest remaining prefill first, as SGLang's and vLLM's
  priority schedulers can): a 30-token prompt that arrives while a 900-token one prefills gets its
  first token at the next step instead of after the long one's every chunk. The long one loses
  only the share of a step the short one takes (its area), not whole steps.
* **Real tokens, not padding**: among the first ``k`` rows in that order, with the width
  ``w = min(their most tokens left, chunk // k)``, the ``k`` whose forward feeds the most real
  tokens less its padded positions (a padded position costs what a real one does and computes
  nothing), the fewest rows on a tie. So the padding is never more than the real tokens (before:
  up to ``k`` times), a lone long prompt still takes whole chunks, a short prompt beside a long one
  takes its tokens while the long one takes the rest of the area, and a handful of tiny prompts
  beside a long one go alone in a small forward rather than padded to a wide one.
  A row never waits behind a later arrival with more tokens left. A long prompt does wait while
  shorter ones fill whole chunks: for ever only if short prompts keep filling every chunk, which is
  an engine past its prefill capacity (where every request waits without bound anyway).

Before this, the rows fed in admission order up to ``--prefill-chunk`` real tokens: a short
prompt behind a long one waited for the long one's every chunk, and a batch of a long row's
remainder and a few short rows was padded to the long row's width (up to ``k`` times the real
tokens computed).
"""

from __future__ import annotations

from collections.abc import Sequence


def prefill_plan(remaining: Sequence[int], chunk: int) -> list[tuple[int, int]]:
    """The rows of a prefill forward, as ``(index into remaining, tokens it feeds)`` in the order
    they go into the forward. ``remaining``: each prefilling row's prompt tokens still to feed (in
    row order, all >= 1; none: an empty plan); ``chunk``: the most tokens (padded positions
    included) of the forward."""
    if chunk < 1 or min(remaining, default=1) < 1:
        raise ValueError(f"a prefill plan needs chunk >= 1 and rows with tokens to feed, got {chunk}, {list(remaining)}")
    order = sorted(range(len(remaining)), key=lambda i: (remaining[i], i))  # fewest left first, then row order
    best_rows, best_width, best_gain = 0, 0, 0
    for rows in range(1, min(len(order), chunk) + 1):
        width = min(remaining[order[rows - 1]], chunk // rows)  # (rows sorted: the last has the most left)
        real = sum(min(remaining[i], width) for i in order[:rows])
        gain = real - (rows * width - real)  # real tokens less padded positions
        if gain > best_gain:
            best_rows, best_width, best_gain = rows, width, gain
    return [(i, min(remaining[i], best_width)) for i in order[:best_rows]]
