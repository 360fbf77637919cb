"""Shared by the consistency tests: one intra-op thread, and seeded weights that make masks matter."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """These models are tiny: one intra-op thread is fastest, and it keeps the run time steady on
    a busy machine (spinning worker threads slow tiny ops many times over). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _kernels_at_every_size(monkeypatch):
    """aiayn.fast routes a call to a kernel only where ``python -m benchmarks.fast`` measured it
    faster (some only on two threads or from a batch size up). These tests run on one thread with
    tiny models, so the speed thresholds are lowered here: every kernel runs wherever it applies and
    is proved equal to the plain path. The thresholds themselves are tested in
    tests/unit/test_fast_routing.py."""
    from aiayn.fast import attention, block_causal, matvec

    monkeypatch.setattr(matvec, "MIN_THREADS_TRANSPOSED", 1)
    monkeypatch.setattr(attention, "MIN_DECODE_QUERIES", 1)
    monkeypatch.setattr(block_causal, "MIN_LENGTH_ONE_THREAD", 2)
