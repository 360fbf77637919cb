"""Peak memory of a call, measured from the allocator events torch.profiler records.

``torch.profiler.profile(profile_memory=True)`` logs every allocation and free of the CPU
allocator (including the scratch buffers a fused kernel allocates internally); PyTorch's memory
profiler (``torch.profiler._memory_profiler.MemoryProfile``, the code behind
``prof.export_memory_timeline``) turns them into a timeline of tensor creations and
destructions. The peak here is the largest sum of bytes created during the call and not yet freed;
tensors that existed before the call (inputs, weights) are not counted. It is a private PyTorch
module: if its interface changes, this function raises rather than guess.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on the CPU by ``fn()`` beyond what existed before (its result dropped)."""
    from torch.profiler import _memory_profiler as mp

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        result = fn()
        del result
    current = peak = 0
    for _t, action, (key, _version), size in mp.MemoryProfile(prof.profiler.kineto_results).timeline:
        if key.device.type != "cpu":
            continue
        if action == mp.Action.CREATE:
            current += size
        elif action == mp.Action.DESTROY:
            current -= size
        peak = max(peak, current)
    return peak


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


__all__ = ["mib", "peak_bytes", "torch"]
