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

**Nothing is read back from the device.** The lengths live twice: ``lengths``, a (b,) tensor on the
cache's device (the slots and masks are computed from it there), and ``host_lengths``, the same
numbers as Python ints, from which every extent is known on the host: the slots attention reads,
the capacity check, the slots a swap copies. ``reserve`` learns each row's real-token count from
the caller (``expect``; the engine builds its rows on the host and knows them) and has the device
check them against the data without waiting (``torch._assert_async``); only eager on the CPU
(``aiayn.nn.data_checks.reads_data``), or when the caller says nothing, does it read the validity
back, and then it checks the right-padding itself with a clear error. So a GPU step queues its work
and never waits for it (tests/serve/test_no_device_reads.py).

Each row's results equal the model run on that row alone (tests/consistency/test_row_kv_cache.py).
Shape letters as in ``aiayn.nn.kv_cache``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Self

import torch
from torch import Tensor

from aiayn.device import to_device
from aiayn.nn import data_checks
from aiayn.nn.kv_cache import (
    BaseKVCache,
    LayerCache,
    LayerKVCache,
    Slots,
)


def _real_counts(new_valid: Tensor, steps: Tensor, counts: Sequence[int] | None) -> list[int]:
    """Each row's real tokens (ints), checked: new_valid (b, t) must be right-padded and, when
    ``counts`` are given, hold exactly that many real tokens per row."""
    b = new_valid.shape[0]
    if counts is not None and len(counts) != b:
        raise ValueError(f"counts gives {len(counts)} rows, the batch has {b}")
    if counts is not None and not data_checks.reads_data(new_valid):
        # Trusted host numbers: the device compares them with the data when it gets there (a
        # mismatch is a device-side assert), and the host does not wait.
        expected = steps < to_device(torch.tensor(counts, dtype=torch.long), new_valid.device)[:, None]
        torch._assert_async((new_valid == expected).all(),  # (b, t) vs (b, t)
                            "RowKVCache.reserve: the rows are not right-padded to the announced counts")
        return [int(n) for n in counts]
    host = new_valid.cpu()  # eager on the CPU: the tensor itself; elsewhere the one read
    found = host.sum(dim=1)  # (b,)
    if not bool((host == (torch.arange(host.shape[1]) < found[:, None])).all()):
        raise ValueError("a RowKVCache takes right-padded rows (each row's real tokens first, "
                         "then padding); left padding would leave gaps in a row")
    real = found.tolist()
    if counts is not None and list(counts) != real:
        raise ValueError(f"the rows hold {real} real token(s), but counts says {list(counts)}")
    return real


class RowCache(BaseKVCache):
    """A cache whose rows fill independently (``RowKVCache``, ``PagedKVCache``): per row, the
    host's count of tokens held (``host_lengths``) and the device's (``lengths``, (b,) long), the
    next forward's announced real-token counts (``expect``), and views of row ranges (``rows``).
    ``length``: the slots the last forward attended over (for a fresh view, its longest row's)."""

    # What a full row's error suggests.
    _full_hint = "send fewer tokens"

    def __init__(self, layers: Sequence[LayerCache], *, batch_size: int, max_len: int,
                 device: torch.device | str | None, quantize: str | None) -> None:
        super().__init__(layers, batch_size=batch_size, max_len=max_len, device=device, quantize=quantize)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.valid.device)
        # The host mirror of ``lengths``: one list for the whole cache, shared by its views (a view
        # sees its rows from ``_first`` on), so a write through a view is seen by the cache.
        self._host: list[int] = [0] * batch_size
        self._first = 0
        self._expected: list[int] | None = None  # the next reserve's real-token counts (``expect``)

    @property
    def host_lengths(self) -> list[int]:
        """Tokens held per row of this cache (view), as ints: ``lengths`` without asking the device."""
        return self._host[self._first: self._first + self.batch_size]

    def expect(self, counts: Sequence[int]) -> RowCache:
        """Tell the next ``reserve`` (the next forward through this cache) that row i brings
        ``counts[i]`` real tokens, its first ones: it then reads nothing back from the device to
        learn them. Returns this cache, to hand on: ``decode_step(model, x, view.expect(counts))``."""
        self._expected = [int(n) for n in counts]
        return self

    def next_positions(self) -> Tensor:
        """(b,) the position of each row's next token: its length (a row holds real tokens only)."""
        return self.lengths.clone()

    def rows(self, start: int, stop: int) -> Self:
        """A view of rows [start, stop): the same buffers (writes through it land here), no copy;
        its masks, positions and lengths sliced, its layers' ``rows`` (each its own object, so two
        views can be reserved for one step, a ragged forward, without clobbering)."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows({start}, {stop}): need 0 <= start < stop <= {self.batch_size}")
        view = copy.copy(self)
        view.valid, view.positions = self.valid[start:stop], self.positions[start:stop]
        view.lengths = self.lengths[start:stop]
        view._first, view._expected = self._first + start, None
        view.batch_size = stop - start
        view.length = max(view.host_lengths)
        view.layers = [layer.rows(start, stop) for layer in self.layers]
        return view

    def _plan(self, new_valid: Tensor, counts: Sequence[int] | None) -> tuple[list[int], int]:
        """Check a forward of new tokens ``new_valid`` (b, t) against this cache: (each row's real
        tokens as ints, the slots attention reads [0, end)). ``counts`` default to ``expect``'s;
        without either the validity is read back (free eager on the CPU; a wait on a GPU)."""
        b, t = new_valid.shape
        if b != self.batch_size:
            raise ValueError(f"this cache (view) has {self.batch_size} rows, got a batch of {b}")
        if counts is None:
            counts = self._expected
        self._expected = None  # an announcement is for one forward
        real = _real_counts(new_valid, torch.arange(t, device=new_valid.device), counts)  # b ints
        lengths = self.host_lengths
        end = max(lengths) + t  # the slots attention reads: [0, end)
        if end > self.max_len:
            row = max(range(b), key=lengths.__getitem__)
            raise ValueError(f"KV cache row {row} is full: it holds {lengths[row]} token(s), "
                             f"{t} more need {end} slots, but a row holds {self.max_len}; {self._full_hint}")
        return real, end

    def _record(self, new_valid: Tensor, new_positions: Tensor, real: list[int], end: int) -> Tensor:
        """Record the new tokens' validity and positions (b, t) at each row's next logical slots,
        advance the lengths (device and host); return those slots (b, t), on the device."""
        slots = self.lengths[:, None] + torch.arange(new_valid.shape[1], device=new_valid.device)  # (b, t)
        self.valid.scatter_(1, slots, new_valid)
        self.positions.scatter_(1, slots, new_positions)
        self.lengths += new_valid.sum(dim=1)  # (b,): the device's own count (checked equal to ``real``)
        for i, n in enumerate(real):
            self._host[self._first + i] += n
        self.length = end
        return slots


class RowKVCache(RowCache):
    """``KVCache``'s constructor (decoder self-attention only; float or quantised) with a length per
    row: row i's tokens in slots [0, lengths[i]) of its own buffer row."""

    _full_hint = "create the cache with a larger max_len or send fewer tokens"

    def __init__(self, *, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 cross_attention: bool = False, quantize: str | None = None, group_size: int | None = None) -> None:
        if cross_attention:
            raise ValueError("RowKVCache is for decoder-only self-attention; it holds no cross-attention")
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs positive batch_size and max_len, got {batch_size} and {max_len}")
        layers = [LayerKVCache(batch_size, n_kv_heads, head_dim, max_len, quantize=quantize, group_size=group_size,
                               dtype=dtype, device=device) for _ in range(n_layers)]
        super().__init__(layers, batch_size=batch_size, max_len=max_len, device=device, quantize=quantize)
        self.layers: list[LayerKVCache] = layers

    def reserve(self, new_valid: Tensor, new_positions: Tensor, counts: Sequence[int] | None = None) -> Slots:
        """Record each row's t new slots (validity and positions, (b, t), real tokens first);
        return them: row i's are [lengths[i], lengths[i] + t), attention reads [0, max + t).

        ``counts`` (default: what ``expect`` announced) are each row's real tokens as host ints;
        without them the validity is read back (free eager on the CPU; a wait on a GPU)."""
        real, end = self._plan(new_valid, counts)
        return Slots.rows(self._record(new_valid, new_positions, real, end), end)

    def clear_row(self, row: int) -> None:
        """Forget row ``row``'s tokens: the row is free for a new sequence (buffers stay allocated)."""
        # In-place fills of views: ``lengths[row] = 0`` would copy a host scalar to the device (a
        # synchronizing copy on CUDA); ``fill_`` passes the value as a kernel argument.
        self.lengths[row].zero_()
        self.valid[row].fill_(False)
        self._host[self._first + row] = 0

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows i and j (their keys, values, validity, positions and lengths)."""
        if i == j:
            return
        host = self._host
        n = max(host[self._first + i], host[self._first + j])  # slots worth copying
        # Plain integer indexing (no index tensor: a list index would be a host-to-device copy).
        if n:
            for layer in self.layers:
                for name in layer._row_buffers:
                    buffer = getattr(layer, name)  # (b, h_kv, s_max, d_h) or its scales
                    _swap(buffer[i, :, :n], buffer[j, :, :n])  # (h_kv, n, d_h) each
        for buffer in (self.valid, self.positions, self.lengths):  # (b, s_max), (b, s_max), (b,)
            _swap(buffer[i], buffer[j])
        host[self._first + i], host[self._first + j] = host[self._first + j], host[self._first + i]

    def reorder(self, indices: Tensor | Sequence[int], *, cross: bool = True) -> None:
        """Select, reorder or repeat rows: new row i is old row ``indices[i]`` (as ``KVCache.reorder``;
        there is no cross-attention here, and ``cross`` is accepted for the loops' calls). ``indices`` as ints are known on the host and read
        nothing back; a tensor is read as ints first (free on the CPU, one wait on a GPU). The
        result is a cache of its own, even from a view."""
        if isinstance(indices, Tensor):
            if indices.dim() != 1 or indices.dtype != torch.long:
                raise ValueError(f"reorder needs a non-empty 1-D long tensor of row indices, got "
                                 f"{indices.dtype} of shape {tuple(indices.shape)}")
            indices = indices.tolist()
        order = [int(i) for i in indices]
        if not order or not all(0 <= i < self.batch_size for i in order):
            raise ValueError(f"reorder needs row indices in [0, {self.batch_size}), got {order}")
        host = self.host_lengths
        index = to_device(torch.tensor(order, dtype=torch.long), self.valid.device)  # (b_new,)
        for layer in self.layers:
            layer.reorder(index, max(host))  # copies the first max(host) slots: all a row holds
        self.valid = self.valid.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        self._host, self._first = [host[i] for i in order], 0
        self.batch_size, self.length = len(order), max(host)

    def reset(self) -> None:
        """Forget all tokens (buffers stay allocated)."""
        self.length = 0
        self.valid.zero_()
        self.lengths.zero_()
        self._host[self._first: self._first + self.batch_size] = [0] * self.batch_size


def _swap(a: Tensor, b: Tensor) -> None:
    """Exchange the contents of two same-shaped views, in place (device copies only)."""
    kept = a.clone()
    a.copy_(b)
    b.copy_(kept)
