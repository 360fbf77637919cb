"""A KV cache whose rows fill independently: what continuous batching needs.

``KVCache`` has one slot counter for the whole batch: every forward appends t slots to every row,
so rows stay aligned and a row that has nothing to add gets padding. That suits one batch decoded
together. A server's batch is not one batch: requests join at any step with prompts of any
length and leave when they finish, so each row is at its own position. ``RowKVCache`` keeps a
length per row instead:

* row i holds its tokens in slots [0, lengths[i]); a forward writes row i's t new tokens at
  [lengths[i], lengths[i] + t) (``reserve`` returns these slots, (b, t), and every layer scatters
  its keys and values there), then advances lengths[i] by the row's *real* tokens. Rows are
  right-padded (real tokens first): the padding's keys land after the row's end, marked invalid,
  and are overwritten by the row's next tokens.
* attention reads slots [0, max over rows of lengths[i] + t) under a key mask (``valid``); since
  the rows' slots do not line up, the stack builds the causal mask from positions instead of slot
  order (``aiayn.nn.masks.position_causal_mask``).
* ``rows(start, stop)`` is a view of a range of rows sharing the buffers: a forward over the view
  reads and writes those rows only, with no copy (a server runs its decoding rows and its
  prefilling rows as two such views). ``clear_row`` frees a row at once; ``swap_rows`` reorders.

Each row's results equal the model run on that row alone (tests/consistency/test_row_kv_cache.py).
Shape letters as in ``aiayn.nn.kv_cache``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from aiayn.nn.kv_cache import KVCache, LayerKVCache


class RowKVCache(KVCache):
    """A ``KVCache`` (same constructor, decoder self-attention only) with a length per row.

    ``lengths`` (b,) long: tokens held per row. ``length``: the slots the last forward attended
    over (for a fresh view, the longest row's length).
    """

    def __init__(self, **kwargs: object) -> None:
        if kwargs.get("cross_attention"):
            raise ValueError("RowKVCache is for decoder-only self-attention; it holds no cross-attention")
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.lengths = torch.zeros(self.batch_size, dtype=torch.long, device=self.valid.device)

    def reserve(self, new_valid: Tensor, new_positions: Tensor) -> Tensor:  # type: ignore[override]
        """Record each row's t new slots (validity and positions, (b, t), real tokens first);
        return their slots (b, t): row i's are [lengths[i], lengths[i] + t)."""
        b, t = new_valid.shape
        if b != self.batch_size:
            raise ValueError(f"this cache (view) has {self.batch_size} rows, got a batch of {b}")
        steps = torch.arange(t, device=new_valid.device)
        counts = new_valid.sum(dim=1)  # (b,) real tokens per row
        if not bool((new_valid == (steps < counts[:, None])).all()):
            raise ValueError("a RowKVCache takes right-padded rows (each row's real tokens first, "
                             "then padding); left padding would leave gaps in a row")
        slots = self.lengths[:, None] + steps  # (b, t)
        end = int(slots[:, -1].max()) + 1
        if end > self.max_len:
            row = int(slots[:, -1].argmax())
            raise ValueError(f"KV cache row {row} is full: it holds {int(self.lengths[row])} token(s), "
                             f"{t} more need {end} slots, but a row holds {self.max_len}; create the cache "
                             f"with a larger max_len or send fewer tokens")
        self.valid.scatter_(1, slots, new_valid)
        self.positions.scatter_(1, slots, new_positions)
        self.lengths += counts
        self.length = end
        return slots

    def rows(self, start: int, stop: int) -> RowKVCache:
        """A view of rows [start, stop): the same buffers (writes through it land here), no copy."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows({start}, {stop}): need 0 <= start < stop <= {self.batch_size}")
        view = copy.copy(self)
        view.layers = [_layer_rows(layer, start, stop) for layer in self.layers]
        view.valid, view.positions = self.valid[start:stop], self.positions[start:stop]
        view.lengths = self.lengths[start:stop]
        view.batch_size = stop - start
        view.length = int(view.lengths.max())
        return view

    def clear_row(self, row: int) -> None:
        """Forget row ``row``'s tokens: the row is free for a new sequence (buffers stay allocated)."""
        self.lengths[row] = 0
        self.valid[row] = False

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows i and j (their keys, values, validity, positions and lengths)."""
        if i == j:
            return
        n = int(torch.maximum(self.lengths[i], self.lengths[j]))  # slots worth copying
        pair, swapped = [i, j], [j, i]
        for layer in self.layers:
            for name in layer._row_buffers:
                buffer = getattr(layer, name)  # (b, h_kv, s_max, d_h) or its scales
                buffer[pair, :, :n] = buffer[swapped, :, :n]
        for buffer in (self.valid, self.positions, self.lengths):
            buffer[pair] = buffer[swapped]

    def reorder(self, indices: Tensor, *, cross: bool = True) -> None:
        self.length = int(self.lengths.max())  # reorder copies the first ``length`` slots
        super().reorder(indices, cross=cross)
        self.lengths = self.lengths.index_select(0, indices.to(self.lengths.device))

    def reset(self) -> None:
        super().reset()
        self.lengths.zero_()


def _layer_rows(layer: LayerKVCache, start: int, stop: int) -> LayerKVCache:
    """A shallow copy of ``layer`` whose buffers are views of rows [start, stop)."""
    view = copy.copy(layer)
    for name in layer._row_buffers:
        setattr(view, name, getattr(layer, name)[start:stop])
    return view
