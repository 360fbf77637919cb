"""aiayn.fast's speed thresholds: each kernel is taken exactly where ``python -m benchmarks.fast``
measured it faster than the plain module (the kernels' results are tested equal to the plain
paths in tests/consistency, with these thresholds lowered)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from aiayn.fast import attention as fast_attention_module
from aiayn.fast.attention import MIN_DECODE_QUERIES, fast_attention
from aiayn.fast.block_causal import MIN_LENGTH_ONE_THREAD, use_block_causal
from aiayn.fast.matvec import (
    EAGER_TRANSPOSED_ROWS,
    MIN_THREADS_TRANSPOSED,
    use_eager_transposed,
    use_transposed,
)


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_transposed_product_needs_two_threads(threads) -> None:
    weight = torch.randn(24, 40)
    low, high = EAGER_TRANSPOSED_ROWS[torch.float32]
    for rows in (1, low, 16, high, high + 1):
        x = torch.randn(rows, 1, 40)
        for n in (1, 2):
            torch.set_num_threads(n)
            in_range = low <= rows <= high
            assert use_eager_transposed(x, weight) == (in_range and n >= MIN_THREADS_TRANSPOSED), (rows, n)
            assert use_transposed(x, weight) == (rows <= high and n >= MIN_THREADS_TRANSPOSED), (rows, n)


@pytest.mark.parametrize(("batch", "heads", "kv_heads"), [(1, 4, 4), (1, 9, 3), (16, 4, 4), (16, 9, 3)])
def test_single_query_path_from_enough_queries(batch: int, heads: int, kv_heads: int, monkeypatch) -> None:
    """The written-out single-query path (need_weights=True inside) from MIN_DECODE_QUERIES queries
    (batch x heads); below, the plain function as called."""
    calls: list[bool] = []
    plain = fast_attention_module.attend

    def spy(*args, **kwargs):
        calls.append(bool(kwargs.get("need_weights")))
        return plain(*args, **kwargs)

    monkeypatch.setattr(fast_attention_module, "attend", spy)
    q = torch.randn(batch, heads, 1, 16)
    k, v = torch.randn(batch, kv_heads, 20, 16), torch.randn(batch, kv_heads, 20, 16)
    with torch.inference_mode():
        out, weights = fast_attention(q, k, v)
        expected, _ = plain(q, k, v)
    assert weights is None and calls == [batch * heads >= MIN_DECODE_QUERIES]
    torch.testing.assert_close(out, expected)


def test_block_causal_on_one_thread_from_min_length(threads) -> None:
    def qkv(t: int) -> torch.Tensor:
        return torch.randn(32, 4, t, 64, requires_grad=True)

    short, long = qkv(32), qkv(MIN_LENGTH_ONE_THREAD)
    torch.set_num_threads(1)
    assert not use_block_causal(short, short, short, 0.0)
    assert use_block_causal(long, long, long, 0.0)
    torch.set_num_threads(2)
    assert use_block_causal(short, short, short, 0.0)
