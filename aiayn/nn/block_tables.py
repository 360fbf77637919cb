"""The host side of a paged KV cache: each row's block table and token count over one ``BlockPool``,
host ints kept apart from the tensors (as vLLM's block manager). The serve scheduler changes them as
it plans a step; the cache's device state follows the recorded ``moves`` (``PagedKVCache.follow``).
"""

from __future__ import annotations

from collections.abc import Sequence

from aiayn.nn.block_pool import BlockPool

# A row move the device state has yet to follow: ("swap", i, j), ("clear", row) or ("adopt", row, tokens).
Move = tuple


class BlockTables:
    """``rows`` rows of up to ``max_len`` tokens over ``n_blocks`` blocks of ``block_size`` tokens.
    ``tables[r]``: row r's block ids in order; ``lengths[r]``: the tokens row r holds."""

    def __init__(self, rows: int, max_len: int, n_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(n_blocks, block_size)
        self.block_size, self.max_len = block_size, max_len
        self.tables: list[list[int]] = [[] for _ in range(rows)]
        self.lengths: list[int] = [0] * rows
        self.moves: list[Move] = []

    def blocks_for(self, row: int, n_tokens: int) -> int:
        """New blocks row ``row`` needs to hold ``n_tokens`` more tokens."""
        return max(0, -(-(self.lengths[row] + n_tokens) // self.block_size) - len(self.tables[row]))

    def grow(self, row: int, n_tokens: int) -> list[int]:
        """Take from the pool the blocks row ``row`` needs for ``n_tokens`` more tokens; its table."""
        table = self.tables[row]
        table.extend(self.pool.allocate() for _ in range(self.blocks_for(row, n_tokens)))
        return table

    def clear(self, row: int) -> None:
        """Forget row ``row``'s tokens; its blocks go back to the pool at once."""
        self.pool.release(self.tables[row])
        self.tables[row] = []
        self.lengths[row] = 0
        self.moves.append(("clear", row))

    def swap(self, i: int, j: int) -> None:
        """Exchange rows i and j (their tables and lengths: no keys move)."""
        if i == j:
            return
        self.tables[i], self.tables[j] = self.tables[j], self.tables[i]
        self.lengths[i], self.lengths[j] = self.lengths[j], self.lengths[i]
        self.moves.append(("swap", i, j))

    def adopt(self, row: int, blocks: Sequence[int]) -> None:
        """Start empty row ``row`` with the shared, full ``blocks`` of a prompt prefix (``pool.lookup``)."""
        if self.lengths[row]:
            raise ValueError(f"row {row} is not empty; clear it before adopting a prefix")
        n = len(blocks) * self.block_size
        if n > self.max_len:
            raise ValueError(f"a prefix of {n} tokens does not fit a row of {self.max_len}")
        for block in blocks:
            self.pool.retain(block)
        self.tables[row], self.lengths[row] = list(blocks), n
        self.moves.append(("adopt", row, n))

    def register(self, row: int, digests: Sequence[bytes]) -> None:
        """Index row ``row``'s full blocks under ``digests`` (``block_digests``), as far as it holds them."""
        table = self.tables[row]
        for k in range(min(len(digests), self.lengths[row] // self.block_size)):
            self.pool.register(table[k], digests[k])

    def take_moves(self) -> list[Move]:
        """The row moves since the last call, in order (the device state follows them)."""
        moves, self.moves = self.moves, []
        return moves
