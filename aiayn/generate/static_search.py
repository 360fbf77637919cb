"""Beam search over static shapes (compiled, and eager on a GPU, where dropping sources syncs every
step): when it is used, and how its cache follows the kept beams."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.generate.ensemble import EnsembleCache
from aiayn.nn.kv_cache import KVCache

# The devices where the search keeps static shapes without compile too (stopped sources masked, not dropped).
STATIC_SEARCH_DEVICES: tuple[str, ...] = ("cuda",)


def static_search(compile: bool, device: torch.device, traced: bool) -> bool:
    """Whether the search keeps static shapes: compiled, or untraced on a ``STATIC_SEARCH_DEVICES`` device."""
    return compile or (not traced and device.type in STATIC_SEARCH_DEVICES)


def follow_in_place(cache: KVCache | EnsembleCache, rows: Tensor) -> None:
    """The static search's cache reorder: row i becomes old row ``rows[i]`` in the same buffers."""
    from aiayn.fast.compiled_decode import reorder_rows_in_place

    for member in cache.members if isinstance(cache, EnsembleCache) else [cache]:
        reorder_rows_in_place(member, rows)
