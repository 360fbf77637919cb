"""The paged KV cache (``PagedKVCache``: a pool of blocks, a block table per row) gives every row what
the model computes for that row alone, as the per-row ``KVCache`` does, also when rows share the blocks of a
common prefix.

The schedules are test_row_kv_cache.py's (rows join, prefill in right-padded chunks of different
widths beside decoding rows, swap, leave and are reused), run with small blocks (4 tokens) so that
rows cross many block boundaries and reuse blocks other rows gave back; at every forward the
logits of each row's real tokens equal a full forward over that row's sequence alone (float32,
``assert_close``'s default tolerances).
"""

from __future__ import annotations

import pytest
import torch
from test_row_kv_cache import (
    SCHEMES,
    Driver,
    decoder_only,
    sequences,
    staggered_schedule,
    sync_errors,
)
from torch.testing import assert_close

from aiayn.device import model_device
from aiayn.models import DecoderOnly
from aiayn.nn.block_pool import BlockPool, OutOfBlocks, block_digests
from aiayn.nn.paged_kv_cache import PagedKVCache

BLOCK = 4


class PagedDriver(Driver):
    """``Driver`` over a ``PagedKVCache`` of ``n_blocks`` blocks of ``BLOCK`` tokens."""

    def __init__(self, model: DecoderOnly, rows: int, max_len: int, *, n_blocks: int = 64,
                 tell: bool = False, no_sync: bool = False) -> None:
        self.model, self.tell, self.no_sync = model, tell, no_sync
        self.cache = model.new_cache(rows, max_len, per_row=True, n_blocks=n_blocks, block_size=BLOCK)
        assert isinstance(self.cache, PagedKVCache)
        self.seqs = [None] * rows
        self.fed = [0] * rows
        self.quantize = None
        self.device = model_device(model)

    def adopt(self, row: int, seq: torch.Tensor, blocks: list[int]) -> None:
        """Start ``row`` on ``seq`` whose first len(blocks) * BLOCK tokens those blocks already hold."""
        self.cache.clear_row(row)
        self.cache.adopt(row, blocks)
        self.seqs[row], self.fed[row] = seq, len(blocks) * BLOCK


@pytest.mark.parametrize("n_kv_heads", [None, 1])
@pytest.mark.parametrize("positional", SCHEMES)
def test_each_row_equals_the_row_alone(positional: str, n_kv_heads: int | None, device: torch.device) -> None:
    staggered_schedule(PagedDriver(decoder_only(positional, n_kv_heads, device=device), rows=3, max_len=16))


def test_rows_told_their_counts_equal_the_row_alone_without_a_sync(device: torch.device) -> None:
    """The serve engine's way (``expect``): on CUDA the forwards run where a sync is an error."""
    model = decoder_only("alibi", 2, device=device)
    staggered_schedule(PagedDriver(model, rows=3, max_len=16, tell=True, no_sync=True))


@pytest.mark.cpu_only  # aiayn.fast.optimize's kernels are CPU code
def test_with_the_fast_kernels() -> None:
    from aiayn.fast import optimize

    model = optimize(decoder_only("rope", 2, device=torch.device("cpu")), mode="inference")
    staggered_schedule(PagedDriver(model, rows=3, max_len=16))


def test_decode_step_by_step_equals_full_recompute(device: torch.device) -> None:
    """Rows at different lengths, one token per row per step, across block boundaries."""
    driver = PagedDriver(decoder_only("rope", 2, device=device), rows=2, max_len=24)
    for row, seq in enumerate(sequences([20, 23], device=device)):
        driver.start(row, seq)
    driver.forward(0, [2, 7])
    for _ in range(13):
        driver.forward(0, [1, 1])


@pytest.mark.parametrize("positional", ["rope", "alibi", "learned"])
def test_rows_sharing_a_prefix_equal_the_row_alone(positional: str, device: torch.device) -> None:
    """Row 0 prefills a 14-token prompt and indexes its 3 full blocks; rows 1 and 2 start from those
    blocks (a prefix-cache hit) with their own continuations, beside row 0; row 0 leaves while they
    still hold the shared blocks. Every row equals the row alone, and the blocks are counted."""
    driver = PagedDriver(decoder_only(positional, 2, device=device), rows=3, max_len=24, n_blocks=16)
    cache, pool = driver.cache, driver.cache.pool
    row_0, tail_1, tail_2 = sequences([20, 9, 9], device=device)
    prompt = row_0[:14]
    driver.start(0, row_0)
    driver.forward(0, [9])
    driver.forward(0, [5])
    digests = block_digests(prompt.tolist(), BLOCK)
    cache.register(0, digests)
    shared = pool.lookup(digests)
    assert shared == cache.table(0)[:3]
    row_1 = torch.cat([prompt[:12], tail_1])  # the same first 12 tokens, then its own
    row_2 = torch.cat([prompt, tail_2])  # the whole prompt and more: its 3 full blocks hit
    driver.adopt(1, row_1, pool.lookup(block_digests(row_1.tolist(), BLOCK)))
    driver.adopt(2, row_2, pool.lookup(block_digests(row_2.tolist(), BLOCK)))
    assert cache.host_lengths == [14, 12, 12]
    assert all(pool.refs(block) == 3 for block in shared)
    driver.forward(0, [1, 3, 6])  # row 2's first new tokens are prompt[12:14] again, in its own block
    driver.forward(0, [1, 1, 2])
    used = pool.used
    cache.clear_row(0)  # row 0 leaves: its private block is free at once, the shared ones stay
    assert pool.used == used - 1 and all(pool.refs(block) == 2 for block in shared)
    driver.forward(1, [1, 1])
    driver.forward(1, [1, 1])
    cache.clear_row(1)
    cache.clear_row(2)
    assert pool.used == 0 and pool.cached == 3  # the prefix stays indexed, evictable
    assert pool.available == pool.capacity


def test_blocks_are_taken_as_rows_grow_and_given_back_at_once(device: torch.device) -> None:
    driver = PagedDriver(decoder_only("rope", device=device), rows=2, max_len=32, n_blocks=7)
    cache, pool = driver.cache, driver.cache.pool
    a, b = sequences([14, 12], device=device)
    driver.start(0, a)
    driver.forward(0, [5])
    assert len(cache.table(0)) == 2 and pool.used == 2
    assert driver.view.layers[0].read_run == 1  # one row on blocks 1, 2: read as a view of the pool, no gather
    driver.start(1, b)
    driver.forward(0, [4, 12])  # row 0 to 9 tokens (3 blocks), row 1 to 12 (3 blocks): 6 of 6
    assert pool.used == 6 and pool.available == 0 and driver.view.layers[0].read_run is None  # two rows: gathered
    with pytest.raises(ValueError, match="out of blocks: this forward needs 1 more, 0 of 6 are free"):
        cache.rows(0, 1).expect([4]).reserve(torch.ones(1, 4, dtype=torch.bool, device=device),
                                             torch.zeros(1, 4, dtype=torch.long, device=device))
    assert cache.host_lengths == [9, 12]  # a refused forward changes nothing
    cache.clear_row(1)
    assert pool.used == 3
    driver.start(1, sequences([12], seed=5, device=device)[0])  # reuses row 1's old blocks
    driver.forward(0, [1, 11])
    driver.forward(0, [1, 1])  # 11 and 12 tokens: 6 blocks again


def test_refusals(device: torch.device) -> None:
    model = decoder_only("rope", device=device)
    with pytest.raises(ValueError, match="int8 cache needs the fixed slots"):
        model.new_cache(2, 16, per_row=True, quantize="int8", n_blocks=8)
    cache = model.new_cache(2, 8, per_row=True, n_blocks=8, block_size=BLOCK)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]], device=device), cache=cache)
        with pytest.raises(ValueError, match="row 0 is full"):
            model(torch.tensor([[1] * 6, [2] * 6], device=device), cache=cache)
    with pytest.raises(ValueError, match="not empty"):
        cache.adopt(0, [])
    with pytest.raises(ValueError, match="moves rows by their block tables"):  # swap_rows, clear_row, adopt
        cache.reorder([1, 0])


@pytest.mark.cpu_only  # host bookkeeping: no tensors
def test_the_pool_evicts_least_recently_released_prefix_tails_first() -> None:
    pool = BlockPool(6, 2)  # 5 usable blocks
    first = [pool.allocate() for _ in range(3)]
    for block, digest in zip(first, block_digests([1, 2, 3, 4, 5, 6], 2), strict=True):
        pool.register(block, digest)
    pool.release(first)  # all three cached, unheld: evictable tail first
    assert pool.available == 5 and pool.cached == 3
    taken = [pool.allocate() for _ in range(3)]  # two free blocks, then the prefix's tail
    assert taken[2] == first[2] and pool.cached == 2
    assert pool.lookup(block_digests([1, 2, 3, 4, 5, 6], 2)) == first[:2]
    assert pool.lookup(block_digests([1, 2, 9, 9], 2)) == first[:1]  # a shared beginning still hits
    assert pool.lookup(block_digests([9, 2, 3, 4], 2)) == []  # a digest names the whole prefix
    pool.retain(first[0])
    pool.allocate()
    with pytest.raises(OutOfBlocks):
        pool.allocate()  # first[0] is held again; first[1] was the last one evicted


@torch.no_grad()
def test_shared_blocks_need_no_host_reads(device: torch.device) -> None:
    """A prefix hit and the forwards after it sync nothing on CUDA (``adopt`` fills on the device)."""
    model = decoder_only("alibi", 2, device=device)
    cache = model.new_cache(2, 16, per_row=True, n_blocks=12, block_size=BLOCK)
    prompt = sequences([10], device=device)[0]
    with sync_errors(device.type == "cuda"):
        expected = model(prompt[None]).logits[0]
        model(prompt[None, :9], cache=cache.rows(0, 1).expect([9]))
        cache.adopt(1, cache.table(0)[:2])
        tokens = torch.stack([prompt[[9, 0]], prompt[8:10]])  # row 0: one token, then padding
        valid = torch.tensor([[True, False], [True, True]], device=device)
        logits = model(tokens, valid=valid, cache=cache.expect([1, 2])).logits
    assert_close(logits[0, 0], expected[9])
    assert_close(logits[1], expected[8:10])


@torch.no_grad()
def test_rows_moved_on_the_host_tables_then_followed_equal_rows_moved_through_the_cache(device: torch.device) -> None:
    """The serve scheduler moves rows on the host block tables as it plans (``BlockTables``: clear,
    swap, adopt) and the runner has the device follow them later: the cache then holds what the
    cache's own row operations give, and a forward before it follows is refused."""
    model = decoder_only("rope", 2, device=device)
    caches = [model.new_cache(3, 16, per_row=True, n_blocks=16, block_size=BLOCK) for _ in range(2)]
    prompts = sequences([9, 6], seed=3, device=device)
    tokens = torch.stack([prompts[0], torch.cat([prompts[1], prompts[1][:3]])])  # row 1 right-padded
    valid = torch.arange(9, device=device)[None] < torch.tensor([[9], [6]], device=device)
    for cache in caches:
        model(tokens, valid=valid, cache=cache.rows(0, 2).expect([9, 6]))
    direct, planned = caches
    shared = direct.table(0)[:2]
    direct.swap_rows(0, 1)
    direct.clear_row(0)
    direct.adopt(2, shared)
    tables = planned.tables
    tables.swap(0, 1)
    tables.clear(0)
    tables.adopt(2, planned.table(1)[:2])
    step = torch.stack([prompts[0][:1], prompts[0][:1], prompts[0][8:9]])
    with pytest.raises(RuntimeError, match="call follow"):
        model(step, cache=planned.expect([1, 1, 1]))
    planned.follow()
    assert planned.host_lengths == direct.host_lengths == [0, 9, 8]
    assert [planned.table(r) for r in range(3)] == [direct.table(r) for r in range(3)]
    assert planned.pool.available == direct.pool.available
    for name in ("valid", "positions", "lengths"):
        assert torch.equal(getattr(planned, name), getattr(direct, name)), name
    assert_close(model(step, cache=planned.expect([1, 1, 1])).logits, model(step, cache=direct.expect([1, 1, 1])).logits)
