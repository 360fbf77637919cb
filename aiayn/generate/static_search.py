"""Beam search over static shapes (``aiayn.generate.beam``'s ``static`` search): when it is used,
and how its cache follows the kept beams without changing the batch.

Static shapes serve the compiled decode step (one graph for every step, a CUDA graph on a GPU), and
on a GPU the eager search too: dropping stopped sources reads the device every step (which sources
stay), a host-device sync the GPU waits on, while a masked source's rows cost a GPU next to nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.generate.ensemble import EnsembleCache
from aiayn.nn.kv_cache import KVCache

# The devices where the search keeps static shapes without compile too (stopped sources masked, not dropped).
STATIC_SEARCH_DEVICES: tuple[str, ...] = ("cuda",)


def static_search(compile: bool, device: torch.device, traced: bool) -> bool:
    """Whether the search keeps static shapes: compiled, or untraced on a ``STATIC_SEARCH_DEVICES``
    device (a trace names the sources still searching, which the dropping search's bookkeeping gives)."""
    return compile or (not traced and device.type in STATIC_SEARCH_DEVICES)


def follow_in_place(cache: KVCache | EnsembleCache, rows: Tensor) -> None:
    """The static search's cache reorder: row i becomes old row ``rows[i]`` in the same buffers."""
    from aiayn.fast.compiled_decode import reorder_rows_in_place

    for member in cache.members if isinstance(cache, EnsembleCache) else [cache]:
        reorder_rows_in_place(member, rows)
