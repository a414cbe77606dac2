"""sglang's allocation shapes on hostpool: `alloc_shm` -> (tensor, fd, mm) and
`alloc_mmap` -> tensor (also `hostpool.alloc_shm` / `hostpool.alloc_mmap`)."""

from __future__ import annotations

import mmap
import time
from typing import TYPE_CHECKING, Any

from hostpool.core.allocators import MmapHostTensorAllocator, ShmHostTensorAllocator
from hostpool.errors import AllocationError
from hostpool.memory.kernel import failure_from_oserror

if TYPE_CHECKING:  # the allocators import it when called (TorchUnavailableError without)
    import torch


def alloc_shm(
    dims: Any, dtype: torch.dtype, *, pool: str = "default", **options: Any
) -> tuple[torch.Tensor, int, mmap.mmap]:
    """sglang's shape: (tensor, fd, mm). The fd is a dup the caller owns and closes.
    The region is handed to the tensor: collected with it, it is a `tensor` release (the
    normal end); `mm.close()` is an explicit release, safe while the tensor lives (the
    pages go with the last view)."""
    allocator = ShmHostTensorAllocator(pool, **options)
    started = time.perf_counter()
    tensor, region = allocator.allocate_region(dims, dtype)
    try:
        fd = region.borrow_fd()
    except OSError as exc:  # no fd left for the caller's copy: undo it, count the failure
        nbytes = region.facts.mapped_bytes
        del tensor, region
        allocator.close()
        error = failure_from_oserror(exc, "alloc_shm: dup of the region's fd", nbytes)
        allocator.count_failure(error, started)
        raise error from exc
    mm = region.mmap()
    if fd is None or mm is None:  # cannot happen for a region just made; never hand out junk
        raise AllocationError("region vanished before it was handed out", reason="other")
    return tensor, fd, mm


def alloc_mmap(
    dims: Any, dtype: torch.dtype, *, pool: str = "default", **options: Any
) -> torch.Tensor:
    """A tensor over anonymous memory; the tensor owns the mapping (collected with it: a
    `tensor` release, the normal end)."""
    return MmapHostTensorAllocator(pool, **options).allocate(dims, dtype)
