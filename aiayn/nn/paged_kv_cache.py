"""A paged KV cache (vLLM's PagedAttention, Kwon et al., 2023): keys and values in a pool of blocks.

Every layer keeps its keys and values in one pool of ``n_blocks`` blocks of ``block_size`` tokens,
(n_blocks, B, h_kv, d_h); row i holds a block table (logical slot s is slot s % B of block
table[s // B]), so memory follows the tokens held, not ``max_len`` per row. Blocks are taken as a
row grows (``reserve``), given back when it leaves (``clear_row``), and shared by rows with a common
prompt prefix (``adopt``; ``aiayn.nn.block_pool``). That bookkeeping is host ints
(``aiayn.nn.block_tables.BlockTables``); the device state follows its row moves (``follow``).

Plain PyTorch attention writes the new keys into their pool slots (``store``) and gathers the rows'
blocks into the contiguous layout SDPA wants (``gather``); ``aiayn.fast.paged_attention`` reads the
pool in place instead. Otherwise this is the per-row ``KVCache``'s contract (nothing read back from
the device; padding writes into the null block); quantised keys are refused.

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
    """``batch_size`` rows of up to ``max_len`` tokens over ``n_blocks`` blocks per layer (block 0 the null
    block); decoder self-attention only. Whoever moves rows in ``tables`` directly (the serve
    scheduler) has the device state ``follow`` them before the next forward."""

    _full_hint = "send fewer tokens"

    def __init__(self, *, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int,
                 n_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, quantize: str | None = None) -> None:
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
        return self.tables.pool

    def table(self, row: int) -> list[int]:
        """Row ``row``'s block table (a copy)."""
        return list(self.tables.tables[self._first + row])

    def blocks_for(self, row: int, n_tokens: int) -> int:
        """New blocks row ``row`` needs to hold ``n_tokens`` more tokens."""
        return self.tables.blocks_for(self._first + row, n_tokens)

    def reserve(self, new_valid: Tensor, new_positions: Tensor, counts: Sequence[int] | None = None) -> Slots:
        """Record each row's t new tokens (b, t), right-padded, taking the blocks they need; return their
        flat pool slots (b, t) (padding: the null block's). ValueError past ``max_len`` or out of blocks."""
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
        """Refused: a repeated row would share its partly filled last block with its copy (no copy-on-write)."""
        raise ValueError("a paged KV cache moves rows by their block tables (swap_rows, clear_row, adopt), "
                         "not by reorder; use a per-row KVCache for beam search")

    def adopt(self, row: int, blocks: Sequence[int]) -> None:
        """Start empty row ``row`` with the shared, full ``blocks`` of a prompt prefix (``pool.lookup``)."""
        self.tables.adopt(self._first + row, blocks)
        self.follow()

    def register(self, row: int, digests: Sequence[bytes]) -> None:
        """Index row ``row``'s full blocks under ``digests`` (``block_digests`` of its tokens)."""
        self.tables.register(self._first + row, digests)

    def follow(self) -> None:
        """Make the device's per-row state follow the row moves the host tables recorded, in order."""
        for move in self.tables.take_moves():
            rows = [r - self._first for r in move[1: 3 if move[0] == "swap" else 2]]
            if not all(0 <= r < self.batch_size for r in rows):
                raise ValueError(f"a move of rows {list(move[1:])} lies outside this view of the cache")
            if move[0] == "swap":
                self._swap_row_state(rows[0], rows[1])
            elif move[0] == "clear":
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
