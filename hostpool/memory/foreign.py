"""Regions over memory another allocator owns (sglang's mooncake, tensorcast, mori...).

hostpool does not map or free such memory; it only describes it: bytes, pool, address, no
fd. The region's holder keeps the foreign tensor alive, and the tensor handed back is built
over the holder, so the region dies with the last view like any torch-backed region.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hostpool.memory.facts import RegionFacts, holder_over_tensor, region_over
from hostpool.memory.holders import tensor_over
from hostpool.memory.region import Region

FOREIGN_BACKEND = "foreign"


def adopt(tensor: Any, pool: str, on_unmapped: Callable[..., None] | None) -> tuple[Region, Any]:
    """(region, tensor over the same memory) for a contiguous CPU tensor made elsewhere."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()  # what a copy costs beats an untracked strided view
    nbytes = max(tensor.numel() * tensor.element_size(), 1)
    holder = holder_over_tensor(tensor, nbytes)  # the foreign memory lives as our views do
    region = region_over(holder, on_unmapped, RegionFacts(pool, "torch", FOREIGN_BACKEND, nbytes))
    view = tensor_over(holder, tuple(tensor.shape), tensor.dtype) if tensor.numel() else tensor
    return region, view
