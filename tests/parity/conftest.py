"""Shared by the parity tests: one intra-op thread (as in tests/consistency)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """These models are tiny: one intra-op thread is fastest, and it keeps the run time steady on
    a busy machine (spinning worker threads slow tiny ops, and Hugging Face's generate, many
    times over). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
