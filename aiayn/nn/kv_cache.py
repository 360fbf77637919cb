"""The model-wide key/value cache for incremental decoding: every layer's storage
(``aiayn.nn.kv_layer.LayerKVCache``) and where a forward's new keys go. Two ways to fill the rows:

* **aligned** (the default): every forward appends t slots to every row (``length``, padding
  included), as one batch decoded together wants (greedy, sampling, beam search's ``reorder``).
* **per row** (``per_row=True``, continuous batching): row i holds slots [0, lengths[i]); a forward
  writes its t new tokens at [lengths[i], lengths[i] + t) (``reserve``), right-padded, and advances
  lengths[i] by its *real* tokens (the padding's keys are overwritten later). Attention reads
  [0, max lengths + t) under ``valid``, causal by positions (``position_causal_mask``). ``rows``
  is a view of some rows sharing the buffers; ``clear_row`` frees a row, ``swap_rows`` reorders.

A per-row cache reads nothing back from the device: the lengths live on the device (``lengths``)
and the host (``host_lengths``), and ``reserve`` takes each row's real-token count from the caller
(``expect``), checked on the device without waiting; only eager on the CPU, or when not told, does
it read the validity back. Shape letters: b batch, h_kv key/value heads, s_max capacity, d_h head width.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Self

import torch
from torch import Tensor

from aiayn.device import to_device
from aiayn.nn import data_checks
from aiayn.nn.kv_layer import LayerKVCache, Slots, swap_in_place
from aiayn.nn.kv_memory import describe_kv_cache, kv_cache_bytes  # noqa: F401  (importable from here too)


class KVCache:
    """A whole model's decoding state: its ``layers``' storage, and per slot (b, s_max) ``valid`` (a real
    token) and ``positions`` (its position id), so later steps mask padded keys and compute relative
    biases. ``length``: the slots the last forward attended over. ``cross``: an encoder-decoder's
    cross-attention (k, v) per decoder layer (float even in a quantised cache)."""

    _full_hint = "create the cache with a larger max_len or send fewer tokens"

    def __init__(self, *, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, cross_attention: bool = False,
                 quantize: str | None = None, group_size: int | None = None, per_row: bool = False) -> None:
        if per_row and cross_attention:
            raise ValueError("a per-row KVCache is for decoder-only self-attention; it holds no cross-attention")
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs positive batch_size and max_len, got {batch_size} and {max_len}")
        layers = [LayerKVCache(batch_size, n_kv_heads, head_dim, max_len, quantize=quantize, group_size=group_size,
                               dtype=dtype, device=device) for _ in range(n_layers)]
        self._start(layers, batch_size=batch_size, max_len=max_len, device=device, quantize=quantize,
                    per_row=per_row)

    def _start(self, layers: Sequence[LayerKVCache], *, batch_size: int, max_len: int,
               device: torch.device | str | None, quantize: str | None, per_row: bool) -> None:
        """The state every cache holds, whatever its layers' layout."""
        self.layers = list(layers)
        self.quantize, self.per_row = quantize, per_row
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.length = 0
        self.batch_size, self.max_len = batch_size, max_len
        # Per row: the tokens each row holds, on the device and on the host; the host list is shared
        # by the cache's views (a view's rows start at ``_first``).
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.valid.device)
        self._host: list[int] = [0] * batch_size
        self._first = 0
        self._expected: list[int] | None = None  # the next reserve's real-token counts (``expect``)

    @property
    def self_nbytes(self) -> int:
        """Bytes of the self-attention key/value buffers (allocated at creation)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def cross(self) -> list[tuple[Tensor, Tensor]] | None:
        """Each decoder layer's cross-attention (k, v), or None until the first forward projected them."""
        pairs = [layer.cross for layer in self.layers]
        return None if any(pair is None for pair in pairs) else pairs  # type: ignore[return-value]

    @cross.setter
    def cross(self, pairs: Sequence[tuple[Tensor, Tensor]] | None) -> None:
        for layer, pair in zip(self.layers, pairs if pairs is not None else [None] * len(self.layers), strict=True):
            layer.cross = pair

    @property
    def cross_nbytes(self) -> int:
        """Bytes of the cross-attention keys/values (0 until the first decode step computes them)."""
        return sum(k.nbytes + v.nbytes for k, v in self.cross or [])

    @property
    def nbytes(self) -> int:
        """Bytes held now, self- and cross-attention (what ``kv_cache_bytes`` estimates)."""
        return self.self_nbytes + self.cross_nbytes

    def reserve(self, new_valid: Tensor, new_positions: Tensor, counts: Sequence[int] | None = None) -> Slots:
        """Record t new slots (validity and positions, (b, t)) and return them: a run from ``length``, or
        per row [lengths[i], lengths[i] + t). ``counts``: each row's real tokens as host ints (default:
        ``expect``'s); without them the validity is read back. Called once per forward."""
        if self.per_row:
            real, end = self._plan(new_valid, counts)
            return Slots.rows(self._record(new_valid, new_positions, real, end), end)
        start, t = self.length, new_valid.shape[1]
        if start + t > self.max_len:
            raise ValueError(f"KV cache is full: {start} slot(s) used + {t} new token(s) > max_len={self.max_len}; "
                             f"create the cache with a larger max_len")
        if new_valid.shape[0] != self.batch_size:
            raise ValueError(f"KV cache was created for batch_size={self.batch_size}, got a batch of {new_valid.shape[0]}")
        self.valid[:, start : start + t] = new_valid
        self.positions[:, start : start + t] = new_positions
        self.length = start + t
        return Slots.run(start, t)

    def next_positions(self) -> Tensor:
        """(b,) the position id of each row's next real token: its real tokens so far."""
        return self.lengths.clone() if self.per_row else self.valid[:, : self.length].sum(dim=1)

    def reorder(self, indices: Tensor | Sequence[int], *, cross: bool = True) -> None:
        """New row i is old row ``indices[i]`` ((b_new,) long, repeats allowed), in every buffer (beam
        search). ``cross=False`` keeps the cross-attention k/v: right when each row is replaced by one
        of the same source. A per-row cache also takes host ints and becomes a cache of its own."""
        if self.per_row:
            order, index, filled = self._row_order(indices)
        else:
            assert isinstance(indices, Tensor)
            if indices.dim() != 1 or indices.dtype != torch.long or indices.numel() == 0:
                raise ValueError(f"reorder needs a non-empty 1-D long tensor of row indices, got "
                                 f"{indices.dtype} of shape {tuple(indices.shape)}")
            if int(indices.min()) < 0 or int(indices.max()) >= self.batch_size:
                raise ValueError(f"reorder: row index out of range for a cache of batch_size={self.batch_size}")
            index, filled = indices.to(self.valid.device), self.length
        for layer in self.layers:
            layer.reorder(index, filled)  # copies the first ``filled`` slots: all a row holds
        self.valid = self.valid.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        if self.per_row:
            host = self.host_lengths
            self._host, self._first, self.length = [host[i] for i in order], 0, filled
        if cross and self.cross is not None:
            self.cross = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross]
        self.batch_size = index.shape[0]

    def _row_order(self, indices: Tensor | Sequence[int]) -> tuple[list[int], Tensor, int]:
        """A per-row reorder's rows, checked: (ints, a tensor on the device, the slots filled)."""
        if isinstance(indices, Tensor):
            if indices.dim() != 1 or indices.dtype != torch.long:
                raise ValueError(f"reorder needs a non-empty 1-D long tensor of row indices, got "
                                 f"{indices.dtype} of shape {tuple(indices.shape)}")
            indices = indices.tolist()
        order = [int(i) for i in indices]
        if not order or not all(0 <= i < self.batch_size for i in order):
            raise ValueError(f"reorder needs row indices in [0, {self.batch_size}), got {order}")
        index = to_device(torch.tensor(order, dtype=torch.long), self.valid.device)  # (b_new,)
        return order, index, max(self.host_lengths)

    def repeat_interleave(self, n: int) -> None:
        """Each row repeated n times in place (b -> b * n rows, copies of one row adjacent)."""
        self.reorder(torch.arange(self.batch_size, device=self.valid.device).repeat_interleave(n))

    def reset(self) -> None:
        """Forget all tokens (buffers stay allocated)."""
        self.length = 0
        self.valid.zero_()
        self.lengths.zero_()
        self._host[self._first: self._first + self.batch_size] = [0] * self.batch_size
        self.cross = None

    # ---- per row ------------------------------------------------------------------------------------
    @property
    def host_lengths(self) -> list[int]:
        """Tokens held per row of this cache (view): ``lengths`` as host ints."""
        return self._host[self._first: self._first + self.batch_size]

    def expect(self, counts: Sequence[int]) -> Self:
        """Tell the next ``reserve`` that row i brings ``counts[i]`` real tokens (its first), so nothing is
        read back; returns this cache: ``decode_step(model, x, view.expect(counts))``."""
        self._per_row_only("expect")
        self._expected = [int(n) for n in counts]
        return self

    def rows(self, start: int, stop: int) -> Self:
        """A view of rows [start, stop) of a per-row cache sharing its buffers (no copy); its layers are
        objects of their own, so two views can be reserved for one ragged step."""
        self._per_row_only("rows")
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

    def clear_row(self, row: int) -> None:
        """Forget row ``row``'s tokens: the row is free for a new sequence (buffers stay allocated)."""
        self._per_row_only("clear_row")
        # In-place fills: ``lengths[row] = 0`` would be a synchronizing host-to-device copy on CUDA.
        self.lengths[row].zero_()
        self.valid[row].fill_(False)
        self._host[self._first + row] = 0

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows i and j (their keys, values, validity, positions and lengths)."""
        self._per_row_only("swap_rows")
        if i == j:
            return
        host = self._host
        n = max(host[self._first + i], host[self._first + j])  # slots worth copying
        if n:
            for layer in self.layers:
                layer.swap_rows(i, j, n)
        self._swap_row_state(i, j)
        host[self._first + i], host[self._first + j] = host[self._first + j], host[self._first + i]

    def _per_row_only(self, method: str) -> None:
        if not self.per_row:
            raise ValueError(f"KVCache.{method} needs a length per row: create the cache with per_row=True")

    def _swap_row_state(self, i: int, j: int) -> None:
        """Exchange rows i and j of ``valid``, ``positions`` and ``lengths`` on the device."""
        for buffer in (self.valid, self.positions, self.lengths):  # (b, s_max), (b, s_max), (b,)
            swap_in_place(buffer[i], buffer[j])

    def _plan(self, new_valid: Tensor, counts: Sequence[int] | None) -> tuple[list[int], int]:
        """Check a per-row forward of ``new_valid`` (b, t): (each row's real tokens, the slots read [0, end))."""
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
        """Record the new tokens (b, t) at each row's next slots, advance the lengths; return the slots."""
        slots = self.lengths[:, None] + torch.arange(new_valid.shape[1], device=new_valid.device)  # (b, t)
        self.valid.scatter_(1, slots, new_valid)
        self.positions.scatter_(1, slots, new_positions)
        self.lengths += new_valid.sum(dim=1)  # (b,): the device's own count (checked equal to ``real``)
        for i, n in enumerate(real):
            self._host[self._first + i] += n
        self.length = end
        return slots


def _real_counts(new_valid: Tensor, steps: Tensor, counts: Sequence[int] | None) -> list[int]:
    """Each row's real tokens (ints), checked: new_valid (b, t) right-padded, matching ``counts`` if given."""
    b = new_valid.shape[0]
    if counts is not None and len(counts) != b:
        raise ValueError(f"counts gives {len(counts)} rows, the batch has {b}")
    if counts is not None and not data_checks.reads_data(new_valid):
        # Trusted host numbers, compared with the data on the device (the host does not wait).
        expected = steps < to_device(torch.tensor(counts, dtype=torch.long), new_valid.device)[:, None]
        torch._assert_async((new_valid == expected).all(),  # (b, t) vs (b, t)
                            "KVCache.reserve (per row): the rows are not right-padded to the announced counts")
        return [int(n) for n in counts]
    host = new_valid.cpu()  # eager on the CPU: the tensor itself; elsewhere the one read
    found = host.sum(dim=1)  # (b,)
    if not bool((host == (torch.arange(host.shape[1]) < found[:, None])).all()):
        raise ValueError("a per-row KV cache takes right-padded rows (each row's real tokens first, "
                         "then padding); left padding would leave gaps in a row")
    real = found.tolist()
    if counts is not None and list(counts) != real:
        raise ValueError(f"the rows hold {real} real token(s), but counts says {list(counts)}")
    return real
