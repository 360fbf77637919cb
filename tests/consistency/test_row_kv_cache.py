"""A cache whose rows fill independently (``KVCache(per_row=True)``, continuous batching) gives every row what
the model computes for that row alone.

Rows join at different steps, prefill in chunks of different widths in one right-padded forward,
decode side by side through views of row ranges, swap places and leave; at every forward the
logits of each row's real tokens equal a full forward over that row's sequence alone (float32,
``assert_close``'s default tolerances). The int8 and int4 caches equal the quantised ``KVCache`` of
the row alone (the same quantisation of the same keys).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from random_weights import randomize_
from torch.testing import assert_close

from aiayn.device import model_device
from aiayn.models import DecoderOnly, get_preset
from aiayn.nn.kv_cache import KVCache

VOCAB = 99
SCHEMES = ["learned", "rope", "alibi", "t5", "sinusoidal"]


def decoder_only(positional: str, n_kv_heads: int | None = None, seed: int = 0, *,
                 device: torch.device) -> DecoderOnly:
    """Seeded on the CPU (the same weights on every device), then moved to ``device``."""
    torch.manual_seed(seed)
    config = get_preset("gpt-tiny", positional=positional, n_kv_heads=n_kv_heads, pad_id=None)
    return randomize_(DecoderOnly(config), seed).eval().to(device)


def sequences(lengths: list[int], seed: int = 3, *, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).to(device) for n in lengths]


class Driver:
    """Feeds chunks of per-row sequences through views of a per-row KVCache and checks each real token's
    logits against the row alone."""

    def __init__(self, model: DecoderOnly, rows: int, max_len: int, *, quantize: str | None = None,
                 tell: bool = False, no_sync: bool = False) -> None:
        """``tell``: each forward's counts are told to the cache (``KVCache.expect``, as the serve
        engine does), which then reads nothing back. ``no_sync`` (with ``tell``, on CUDA): the
        forwards run under ``torch.cuda.set_sync_debug_mode("error")``: a host-device sync fails."""
        self.model = model
        self.tell, self.no_sync = tell, no_sync
        self.cache = model.new_cache(rows, max_len, per_row=True, quantize=quantize)
        assert type(self.cache) is KVCache and self.cache.per_row
        self.seqs: list[torch.Tensor | None] = [None] * rows
        self.fed = [0] * rows  # tokens of each row's sequence already in the cache
        self.quantize = quantize
        self.device = model_device(model)

    def start(self, row: int, seq: torch.Tensor) -> None:
        with sync_errors(self.no_sync and self.device.type == "cuda"):
            self.cache.clear_row(row)
        self.seqs[row], self.fed[row] = seq, 0

    def swap(self, i: int, j: int) -> None:
        with sync_errors(self.no_sync and self.device.type == "cuda"):
            self.cache.swap_rows(i, j)
        self.seqs[i], self.seqs[j] = self.seqs[j], self.seqs[i]
        self.fed[i], self.fed[j] = self.fed[j], self.fed[i]

    @torch.no_grad()
    def forward(self, start: int, counts: list[int]) -> None:
        """One forward over rows [start, start + len(counts)): row start + k takes its next counts[k]
        tokens (right-padded to the widest)."""
        t = max(counts)
        tokens = torch.randint(0, VOCAB, (len(counts), t), device=self.device)  # junk where padded
        valid = torch.zeros(len(counts), t, dtype=torch.bool, device=self.device)
        for k, n in enumerate(counts):
            row = start + k
            tokens[k, :n] = self.seqs[row][self.fed[row]: self.fed[row] + n]
            valid[k, :n] = True
        with sync_errors(self.no_sync and self.device.type == "cuda"):
            view = self.view = self.cache.rows(start, start + len(counts))  # (the last forward's view)
            logits = self.model(tokens, valid=valid, cache=view.expect(counts) if self.tell else view).logits
        for k, n in enumerate(counts):
            row = start + k
            end = self.fed[row] + n
            expected = self.alone(self.seqs[row][:end])[self.fed[row]:end]
            assert_close(logits[k, :n], expected)
            self.fed[row] = end
        assert self.cache.lengths[start: start + len(counts)].tolist() == [self.fed[start + k] for k in range(len(counts))]

    def alone(self, seq: torch.Tensor) -> torch.Tensor:
        """(n, v) logits of the row alone: a full forward, or (int8) its own int8 KVCache fed alike."""
        if self.quantize is None:
            return self.model(seq[None]).logits[0]
        cache = self.model.new_cache(1, len(seq), quantize=self.quantize)
        return self.model(seq[None], cache=cache).logits[0]


@contextmanager
def sync_errors(on: bool) -> Iterator[None]:
    """CUDA's sync debug mode "error" while ``on``: any host-device synchronisation raises."""
    if not on:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def staggered_schedule(driver: Driver) -> None:
    """Rows join, prefill in chunks beside decoding rows, swap, leave and are reused."""
    a, b, c, d = sequences([12, 13, 11, 9], device=driver.device)
    driver.start(0, a)
    driver.forward(0, [4])  # row 0 prefills 4 tokens alone
    driver.start(1, b)
    driver.forward(0, [1, 5])  # row 0 decodes one token while row 1 prefills 5 (padded batch)
    driver.forward(0, [1, 1])  # both decode
    driver.start(2, c)
    driver.forward(2, [3])  # row 2 prefills through its own view ...
    driver.forward(0, [1, 1])  # ... while rows 0-1 decode through theirs
    driver.forward(0, [2, 3, 4])  # three widths in one forward
    driver.swap(0, 2)
    driver.forward(0, [1, 1, 1])
    driver.start(1, d)  # row 1 leaves; d takes its place
    driver.forward(1, [6, 1])
    driver.forward(0, [1, 1, 1])


@pytest.mark.parametrize("n_kv_heads", [None, 1])
@pytest.mark.parametrize("positional", SCHEMES)
def test_each_row_equals_the_row_alone(positional: str, n_kv_heads: int | None, device: torch.device) -> None:
    staggered_schedule(Driver(decoder_only(positional, n_kv_heads, device=device), rows=3, max_len=16))


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_rows_told_their_counts_equal_the_row_alone_without_a_sync(quantize: str | None, device: torch.device) -> None:
    """The serve engine's way: each forward's real-token counts told to the cache (``expect``), so
    it reads nothing back from the device; on CUDA the forwards run where a sync is an error (ALiBi:
    the learned, sinusoidal and rotary modules still read their positions' maximum, see
    tests/serve/test_no_device_reads.py). Each row still equals the row alone."""
    model = decoder_only("alibi", 2, device=device)
    staggered_schedule(Driver(model, rows=3, max_len=16, quantize=quantize, tell=True, no_sync=True))


@pytest.mark.cpu_only  # aiayn.fast.optimize's kernels are CPU code
def test_with_the_fast_kernels() -> None:
    from aiayn.fast import optimize

    model = optimize(decoder_only("rope", 2, device=torch.device("cpu")), mode="inference")
    staggered_schedule(Driver(model, rows=3, max_len=16))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_quantised_cache_equals_the_row_alone_in_a_quantised_cache(quantize: str, device: torch.device) -> None:
    staggered_schedule(Driver(decoder_only("rope", 2, device=device), rows=3, max_len=16, quantize=quantize))


def test_decode_step_by_step_equals_full_recompute(device: torch.device) -> None:
    """Rows at different lengths, one token per row per step, for many steps."""
    model = decoder_only("rope", 2, device=device)
    driver = Driver(model, rows=2, max_len=24)
    for row, seq in enumerate(sequences([20, 23], device=device)):
        driver.start(row, seq)
    driver.forward(0, [2, 7])
    for _ in range(13):
        driver.forward(0, [1, 1])


def test_a_view_writes_through_and_clear_row_frees(device: torch.device) -> None:
    model = decoder_only("rope", device=device)
    cache = model.new_cache(3, 8, per_row=True)
    view = cache.rows(1, 3)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3], [4, 5, 0]], device=device),
              valid=torch.tensor([[True] * 3, [True, True, False]], device=device), cache=view)
    assert cache.lengths.tolist() == [0, 3, 2]
    assert cache.valid[:, :3].tolist() == [[False] * 3, [True] * 3, [True, True, False]]
    assert cache.layers[0].k[1:, :, :3].abs().sum() > 0 and cache.layers[0].k[0].abs().sum() == 0
    cache.clear_row(1)
    assert cache.lengths.tolist() == [0, 0, 2] and not bool(cache.valid[1].any())


def test_refuses_left_padding_and_overflow(device: torch.device) -> None:
    model = decoder_only("rope", device=device)
    cache = model.new_cache(2, 4, per_row=True)
    with torch.no_grad(), pytest.raises(ValueError, match="right-padded"):
        model(torch.tensor([[1, 2], [3, 4]], device=device),
              valid=torch.tensor([[False, True], [True, True]], device=device), cache=cache)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]], device=device), cache=cache)
        with pytest.raises(ValueError, match="row 0 is full"):
            model(torch.tensor([[1, 2], [3, 4]], device=device),
                  valid=torch.tensor([[True, True], [False, False]], device=device), cache=cache)


@pytest.mark.cpu_only
def test_an_aligned_cache_refuses_the_per_row_operations() -> None:
    """An aligned cache's rows share one length: a view of some rows, a cleared or swapped row, or
    announced per-row counts would desynchronise them, so each is refused in one line."""
    cache = KVCache(n_layers=1, batch_size=2, n_kv_heads=1, head_dim=4, max_len=8)
    for call in (lambda: cache.rows(0, 1), lambda: cache.clear_row(0), lambda: cache.swap_rows(0, 1),
                 lambda: cache.expect([1, 1])):
        with pytest.raises(ValueError, match="needs a length per row: create the cache with per_row=True"):
            call()
