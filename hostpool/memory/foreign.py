"""Regions over memory another allocator owns (sglang's mooncake, tensorcast, mori...).

hostpool does not map or free such memory; it only describes it: bytes, pool, address, no
fd. The region's holder keeps the foreign tensor alive, and the tensor handed back is built
over the holder, so the region dies with the last view like any torch-backed region.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hostpool.memory import syscalls
from hostpool.memory.holders import holder_type, tensor_over
from hostpool.memory.region import Region, new_region

FOREIGN_BACKEND = "foreign"


def adopt(tensor: Any, pool: str, on_unmapped: Callable[..., None] | None) -> tuple[Region, Any]:
    """(region, tensor over the same memory) for a contiguous CPU tensor made elsewhere."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()  # what a copy costs beats an untracked strided view
    nbytes = max(tensor.numel() * tensor.element_size(), 1)
    address = int(tensor.data_ptr())
    holder = holder_type(nbytes).from_address(address)
    holder._owner = tensor  # type: ignore[attr-defined]  # the foreign allocator's memory lives as long as our views
    region = new_region(
        holder,
        on_unmapped,
        pool=pool,
        kind="torch",
        backend=FOREIGN_BACKEND,
        name=None,
        requested_bytes=nbytes,
        mapped_bytes=nbytes,
        page_size=syscalls.PAGE_SIZE,
        address=address,
        populate_mode="none",
        populate_seconds=0.0,
    )
    view = tensor_over(holder, tuple(tensor.shape), tensor.dtype) if tensor.numel() else tensor
    return region, view
