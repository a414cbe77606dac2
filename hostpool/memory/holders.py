"""What a region's tensors are built over, and the regions made over a holder.

- The holder: a ctypes array over the mapping (or over memory torch or another allocator
  owns), and tensors over it that keep it alive (`holder_type`, `tensor_over`).
- A region over a holder, made the same way by every maker (hostpool's mappings, torch's
  memory, memory another allocator owns): its address and mapped bytes are its holder's,
  never stated twice (`region_over`).
- Regions over memory another allocator owns (sglang's mooncake, tensorcast, mori...;
  `adopt`): hostpool does not map or free such memory, it only describes it (bytes, pool,
  address, no fd). The holder keeps the foreign tensor alive, and the tensor handed back
  is built over the holder, so the region dies with the last view like any torch-backed
  region.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from typing import Any

from hostpool._lazy import require_torch
from hostpool.memory.region import Region, new_region


@functools.lru_cache(maxsize=512)
def holder_type(nbytes: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    """The ctypes array type of a region's holder of `nbytes` bytes. It carries a
    `__dict__`, so a holder over memory torch or another allocator owns can keep that
    memory's owner alive (`holder.keeps_alive = tensor`)."""
    return type("RegionBuffer", (ctypes.c_ubyte * nbytes,), {})


def tensor_over(holder: Any, dims: tuple[int, ...], dtype: Any) -> Any:
    """A tensor of `dims`/`dtype` over a Region's holder (the tensor keeps it alive).
    Raises TorchUnavailableError without torch."""
    torch = require_torch("a tensor over a host region")

    count = math.prod(dims)
    if count == 0:
        return torch.frombuffer(holder, dtype=dtype, count=1)[:0].reshape(dims)
    return torch.frombuffer(holder, dtype=dtype, count=count).reshape(dims)


def region_over(holder: Any, on_unmapped: Callable[..., None] | None, **facts: Any) -> Region:
    """`new_region(holder, on_unmapped, ...)` whose address and mapped bytes are the
    holder's, with `facts` (the other `RegionFacts` fields the maker knows: pool, kind,
    backend, requested_bytes, populate...) and new_region's own keywords (mapping, fd,
    pinned_chunks). Raises TypeError for a keyword neither takes."""
    return new_region(
        holder,
        on_unmapped,
        address=ctypes.addressof(holder),
        mapped_bytes=ctypes.sizeof(holder),
        **facts,
    )


def holder_over_tensor(tensor: Any, nbytes: int) -> Any:
    """A holder of `nbytes` over a CPU tensor's memory that keeps the tensor (the memory's
    owner: torch, or another allocator) alive as long as any view of the holder."""
    holder = holder_type(nbytes).from_address(int(tensor.data_ptr()))
    holder.keeps_alive = tensor  # type: ignore[attr-defined]  # holder_type gives it a __dict__
    return holder


FOREIGN_BACKEND = "foreign"


def adopt(tensor: Any, pool: str, on_unmapped: Callable[..., None] | None) -> tuple[Region, Any]:
    """(region, tensor over the same memory) for a contiguous CPU tensor made elsewhere."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()  # what a copy costs beats an untracked strided view
    nbytes = max(tensor.numel() * tensor.element_size(), 1)
    holder = holder_over_tensor(tensor, nbytes)  # the foreign memory lives as our views do
    region = region_over(
        holder,
        on_unmapped,
        pool=pool,
        kind="torch",
        backend=FOREIGN_BACKEND,
        requested_bytes=nbytes,
    )
    view = tensor_over(holder, tuple(tensor.shape), tensor.dtype) if tensor.numel() else tensor
    return region, view
