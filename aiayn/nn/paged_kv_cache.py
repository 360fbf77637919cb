"""A paged KV cache: keys and values in a pool of fixed-size blocks, a block table per row.

A per-row ``KVCache`` gives each row a slot of ``max_len`` tokens: memory follows the longest possible
request. ``PagedKVCache`` follows vLLM's PagedAttention (Kwon et al., 2023): every layer keeps its
keys and values in one pool of ``n_blocks`` blocks of ``block_size`` tokens, (n_blocks, block_size,
h_kv, d_h) each, and row i holds a block table, the ids of the blocks that hold its tokens in order
(logical slot s of the row is slot s % block_size of block table[s // block_size]). Blocks are
taken from the pool as a row grows (``reserve``) and go back at once when it leaves
(``clear_row``); rows may share the full blocks of a common prompt prefix (``adopt``; see
``aiayn.nn.block_pool`` for the reference counts, the prefix index and why no copy-on-write is
needed). That bookkeeping (tables, lengths, pool) is host ints, held apart from the tensors by
``aiayn.nn.block_tables.BlockTables``; a row operation changes it first, then the device state
follows (``follow``).

Attention over it, plain PyTorch (the reference, and the path everywhere but below): each layer
writes the new keys and values into their pool slots (``store``: ``index_copy_`` at flat slot ids,
(b * t,), computed on the host from the tables) and then gathers the rows' blocks into the
contiguous layout ``F.scaled_dot_product_attention`` wants (``gather``: ``index_select`` of whole
blocks by the (b, n) block table, padded with the null block, viewed as (b, n * block_size, h_kv,
d_h) and cut to the extent the rows need). That gather is the price of paging on top of
the per-row ``KVCache``'s in-place read. On the CPU, a model converted by ``aiayn.fast.optimize`` skips it
for decode steps: ``aiayn.fast.paged_attention`` stores the keys and reads the pool in place through
``read_blocks`` (a C++ kernel; ``python -m benchmarks.kv_cache --paged`` measures both).

Everything else is the per-row ``KVCache``'s contract (``PagedKVCache`` derives from it), so the
stacks and the serve engine use it the same way (``swap_rows`` here swaps two tables: no keys move),
and **nothing is read back from the device**. Padding tokens of a right-padded forward write into
the null block and are masked. Quantised keys and values are refused (use a per-row ``KVCache``).

Shape letters: b rows, t new tokens, n blocks per row, B block_size, h_kv key/value heads, d_h head width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from aiayn.device import to_device
from aiayn.nn.block_pool import NULL_BLOCK, BlockPool
from aiayn.nn.block_tables import BlockTables
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.kv_layer import LayerKVCache, Slots


class PagedKVCache(KVCache):
    """``rows`` sequences over a pool of ``n_blocks`` blocks of ``block_size`` tokens per layer (block 0
    the null block); each row holds up to ``max_len`` tokens. Decoder self-attention only.
    ``tables``: the host bookkeeping (``BlockTables``); whoever moves its rows there directly (the
    serve scheduler, as it plans) has the device state ``follow`` them before the next forward."""

    _full_hint = "send fewer tokens"

    def __init__(self, *, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int,
                 n_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, cross_attention: bool = False,
                 quantize: str | None = None, group_size: int | None = None) -> None:
        if cross_attention:
            raise ValueError("PagedKVCache is for decoder-only self-attention; it holds no cross-attention")
        if quantize is not None:
            raise ValueError(f"the paged KV cache holds float keys and values; a {quantize} cache needs the "
                             f"fixed slots (a per-row KVCache; aiayn serve --kv-layout slots)")
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"PagedKVCache needs positive batch_size and max_len, got {batch_size} and {max_len}")
        self.tables = BlockTables(batch_size, max_len, n_blocks, block_size)
        self.block_size = block_size
        layers = [LayerKVCache.pool(n_blocks, block_size, n_kv_heads, head_dim, dtype=dtype, device=device)
                  for _ in range(n_layers)]
        self._start(layers, batch_size=batch_size, max_len=max_len, device=device, quantize=None, per_row=True)
        self._host = self.tables.lengths  # the host lengths are the tables' (shared with the views)

    @property
    def pool(self) -> BlockPool:
        """The blocks' reference counts and prefix index (``aiayn.nn.block_pool.BlockPool``)."""
        return self.tables.pool

    def table(self, row: int) -> list[int]:
        """Row ``row``'s block table (a copy)."""
        return self.tables.table(self._first + row)

    def blocks_for(self, row: int, n_tokens: int) -> int:
        """New blocks row ``row`` needs to hold ``n_tokens`` more tokens."""
        return self.tables.blocks_for(self._first + row, n_tokens)

    def reserve(self, new_valid: Tensor, new_positions: Tensor, counts: Sequence[int] | None = None) -> Slots:
        """Record each row's t new tokens (validity and positions, (b, t), real tokens first), taking
        the blocks they need from the pool; return their flat pool slots (b, t) (padding: the null
        block's). ValueError when a row would pass ``max_len`` or the pool has too few blocks."""
        if self.tables.moves:
            raise RuntimeError("the block tables moved rows the device has not followed; call follow() first")
        b, t = new_valid.shape
        real, end = self._plan(new_valid, counts)  # b ints, checked; logical slots read: [0, end)
        lengths = self.host_lengths
        needed = sum(self.blocks_for(i, n) for i, n in enumerate(real))
        if needed > self.pool.available:
            raise ValueError(f"the paged KV cache is out of blocks: this forward needs {needed} more, "
                             f"{self.pool.available} of {self.pool.capacity} are free; free rows first")
        B, slots = self.block_size, []
        for i, n in enumerate(real):
            table = self.tables.grow(self._first + i, n)
            start = lengths[i]
            slots.append([table[(start + j) // B] * B + (start + j) % B if j < n else NULL_BLOCK * B
                          for j in range(t)])
        width = -(-end // B)  # blocks per row read, n
        tables = [self.tables.tables[self._first + i][:width] for i in range(b)]
        tables = [table + [NULL_BLOCK] * (width - len(table)) for table in tables]
        # Built on the host, one copy each (to_device pins and does not wait on CUDA).
        write_slots = to_device(torch.tensor(slots, dtype=torch.long).reshape(b, t), new_valid.device)
        first = tables[0][0]
        run = first if b == 1 and tables[0] == list(range(first, first + width)) and first != NULL_BLOCK else None
        read_blocks = to_device(torch.tensor(tables, dtype=torch.long).reshape(b, width), new_valid.device)
        self._record(new_valid, new_positions, real, end)
        for layer in self.layers:
            layer.read_blocks, layer.read_end, layer.read_run = read_blocks, end, run
        return Slots.rows(write_slots, end)

    # ---- rows: the host tables move, then the device state follows -----------------------------------
    def clear_row(self, row: int) -> None:
        """Forget row ``row``'s tokens and give its blocks back to the pool at once."""
        self.tables.clear(self._first + row)
        self.follow()

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows i and j: their tables and per-row state (no keys or values move)."""
        self.tables.swap(self._first + i, self._first + j)
        self.follow()

    def reorder(self, indices: Tensor | Sequence[int], *, cross: bool = True) -> None:
        """Refused: a repeated row would share its last, partly filled block with its copy, which
        both would then write (there is no copy-on-write); rows move by ``swap_rows``, ``clear_row``
        and ``adopt``."""
        raise ValueError("a paged KV cache moves rows by their block tables (swap_rows, clear_row, adopt), "
                         "not by reorder; use a per-row KVCache for beam search")

    def adopt(self, row: int, blocks: Sequence[int]) -> None:
        """Start empty row ``row`` with the full, computed ``blocks`` of a prompt prefix (a prefix-cache
        hit: ``pool.lookup``): the row holds them (shared) and continues after their tokens."""
        self.tables.adopt(self._first + row, blocks)
        self.follow()

    def register(self, row: int, digests: Sequence[bytes]) -> None:
        """Index row ``row``'s full blocks under ``digests`` (``block_digests`` of its tokens), as far as
        the row holds them: its first min(len(digests), length // block_size) blocks."""
        self.tables.register(self._first + row, digests)

    def follow(self) -> None:
        """Make the device's per-row state (validity, positions, lengths) follow the row moves the
        host tables recorded, in order (device work only: nothing is read back)."""
        for move in self.tables.take_moves():
            rows = [r - self._first for r in move[1: 3 if move[0] == "swap" else 2]]
            if not all(0 <= r < self.batch_size for r in rows):
                raise ValueError(f"a move of rows {list(move[1:])} lies outside this view of the cache")
            if move[0] == "swap":
                self._swap_row_state(rows[0], rows[1])
            elif move[0] == "clear":
                # In-place fills of views: a host scalar assigned would be a (synchronizing) copy.
                self.lengths[rows[0]].zero_()
                self.valid[rows[0]].fill_(False)
            else:  # adopt: the row holds move[2] tokens, the token in logical slot s at position s
                row, n = rows[0], move[2]
                if n:
                    self.lengths[row].fill_(n)
                    self.valid[row, :n].fill_(True)
                    self.positions[row, :n].copy_(torch.arange(n, device=self.positions.device))

    def reset(self) -> None:
        for row in range(self.batch_size):
            self.tables.clear(self._first + row)
        self.follow()
        self.length = 0
