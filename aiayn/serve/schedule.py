"""Which prompt tokens the serve engine's prefill feeds at a step (``aiayn.serve.scheduler``).

``--prefill-chunk`` is a budget of prompt tokens per step (vLLM's ``max_num_batched_tokens``):
the prefilling rows share it, and each feeds its share as a part of its own in the step's one
packed forward (``aiayn.generate.step.decode_ragged``), so no row is padded to another's width and
the step costs about the real tokens it feeds.

* **Fewest tokens left first** (shortest remaining prefill first, as SGLang's and vLLM's
  priority schedulers can): a 30-token prompt that arrives while a 900-token one prefills gets its
  first token at the next step instead of after the long one's every chunk. The long one loses
  only the short one's tokens of that step's budget, not whole steps.
* **Each row takes what is left of the budget**: in that order, a row feeds all the tokens it has
  left, or the rest of the budget, and the next row the rest after it. So a lone long prompt takes
  whole chunks, a short prompt beside a long one takes its tokens while the long one takes the
  rest, and tiny prompts beside a long one go in the same forward at no padding cost.
  A row never waits behind a later arrival with more tokens left. A long prompt does wait while
  shorter ones fill whole chunks: for ever only if short prompts keep filling every chunk, which is
  an engine past its prefill capacity (where every request waits without bound anyway).

"""

from __future__ import annotations

from collections.abc import Sequence


def prefill_plan(remaining: Sequence[int], chunk: int) -> list[tuple[int, int]]:
    """The rows of this step's prefill, as ``(index into remaining, tokens it feeds)`` in the order
    they go into the forward. ``remaining``: each prefilling row's prompt tokens still to feed (in
    row order, all >= 1; none: an empty plan); ``chunk``: the step's budget of prompt tokens."""
    if chunk < 1 or min(remaining, default=1) < 1:
        raise ValueError(f"a prefill plan needs chunk >= 1 and rows with tokens to feed, got {chunk}, {list(remaining)}")
    plan, budget = [], chunk
    for i in sorted(range(len(remaining)), key=lambda i: (remaining[i], i)):  # fewest left first, then row order
        if budget == 0:
            break
        take = min(remaining[i], budget)
        plan.append((i, take))
        budget -= take
    return plan
