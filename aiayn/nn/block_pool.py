"""The blocks of a paged KV cache (vLLM's block manager in miniature, host ints only): reference
counts; a prefix index of full prompt blocks under chained digests (``block_digests``), shared by
later prompts with the same start (rows write only at their own end: no copy-on-write); LRU eviction
of indexed blocks nobody holds. Block 0, the null block, pads block tables and takes padding's writes."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import takewhile

NULL_BLOCK = 0


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left in the pool."""


def block_digests(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained digest of each full block of ``tokens``: digest i (sha256 of digest i - 1 and block
    i's ids) names tokens[: (i + 1) * block_size]."""
    digests, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start: start + block_size]
        parent = hashlib.sha256(parent + b"".join(int(t).to_bytes(4, "little", signed=True) for t in block)).digest()
        digests.append(parent)
    return digests


class BlockPool:
    """``n_blocks`` blocks (block 0 the null block): reference counts, the prefix index and its LRU."""

    def __init__(self, n_blocks: int, block_size: int) -> None:
        if n_blocks < 2 or block_size < 1:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block) and block_size >= 1, "
                             f"got {n_blocks} blocks of {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free: deque[int] = deque(range(1, n_blocks))
        self._refs = [0] * n_blocks
        self._digest_of: dict[int, bytes] = {}  # registered block -> the digest of the prefix it ends
        self._by_digest: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by none: LRU first

    @property
    def capacity(self) -> int:
        """Blocks a row can ever hold: all but the null block."""
        return self.n_blocks - 1

    @property
    def available(self) -> int:
        """Blocks ``allocate`` can hand out now: free ones plus cached ones held by nobody."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks held by at least one row."""
        return self.capacity - self.available

    @property
    def cached(self) -> int:
        """Blocks in the prefix index (held or not)."""
        return len(self._by_digest)

    def allocate(self) -> int:
        """A block for one row: a free one, else the least recently released cached one."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_digest[self._digest_of.pop(block)]
        else:
            raise OutOfBlocks(f"all {self.capacity} KV-cache blocks are in use")
        self._refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more row holds ``block`` (a prefix hit)."""
        if self._refs[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is neither held nor cached; it cannot be shared")
            del self._evictable[block]
        self._refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """A row lets go of ``blocks`` (its table, in order), tail first."""
        for block in reversed(blocks):
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} released more often than held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._evictable[block] = None  # most recently released last
                else:
                    self._free.append(block)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def register(self, block: int, digest: bytes) -> None:
        """Index a full block under its prefix digest; a digest or block already indexed stays as it is."""
        if block in self._digest_of or digest in self._by_digest:
            return
        self._digest_of[block] = digest
        self._by_digest[digest] = block

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """The blocks of the longest indexed prefix of ``digests`` (not yet retained)."""
        return list(takewhile(lambda block: block is not None, map(self._by_digest.get, digests)))
