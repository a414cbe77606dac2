"""sglang's host-allocator entry points, backed by hostpool: a server switches its imports
from `sglang.srt.mem_cache.memory_pool_host` (or `pool_host.common`,
`storage.mmap`) to this module and changes nothing else.

What sglang's own callers and tests rely on, and how it holds here:
- `alloc_shm(dims, dtype)` returns `(tensor, fd, mm)`: `mm` is an `mmap.mmap` whose
  `close()` is safe while the tensor lives (the pages go with the last view); the fd is
  the caller's to close.
- memfd names start with sglang's `sglang_host_pool_` (then `<pool>.<pid>.<seq>`), so
  sglang's tools and hostpool's procfs, inspect and leak check all recognise them.
- a non-CPU device is an AssertionError naming "only supports CPU allocations".
- an allocator dropped without `close()` has its fds closed when it is collected (sglang's
  `__del__`, here a `weakref.finalize`); the mappings leave with their last view.
- unknown allocator types fall back to the default allocator with a warning, as sglang
  does when a backend's allocator cannot be imported.
Every allocation is recorded in hostpool's ledger: metrics, inspect and leak checks
see sglang's pools like any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
import re
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from hostpool import allocators as _hp
from hostpool import events
from hostpool.errors import ConfigError, InvalidRequestError
from hostpool.memory import cuda, kernel, syscalls
from hostpool.memory.region import Kind, Region
from hostpool.storage.registry import resolve_allocator

SGLANG_PREFIX = "sglang_host_pool_"
DEFAULT_POOL = "default"
REGISTER_CHUNK_ENV = "SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB"  # sglang's knob, in GiB
REGISTERED_RANGES_ATTR = "_sglang_cuda_host_registered_ranges"
_POOL_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def _require_cpu(owner: object, device: object) -> None:
    """sglang's contract: AssertionError for a device that is not the CPU."""
    try:
        _hp.check_device(device)
    except InvalidRequestError as exc:
        raise AssertionError(
            f"{type(owner).__name__} only supports CPU allocations; got device={device!r}"
        ) from exc


class HostTensorAllocator(_hp.HostTensorAllocator):
    """sglang's base allocator: no-argument constructor, anonymous mmap memory."""

    kind: ClassVar[Kind] = "mmap"
    registered_name: ClassVar[str] = "mmap"
    # hostpool maps hugetlb for both kinds when asked (`hugepages=`).
    uses_hugetlb: ClassVar[bool] = True

    def __init__(self, pool: str = DEFAULT_POOL, **options: Any) -> None:
        options.setdefault("name_prefix", SGLANG_PREFIX)
        super().__init__(pool, **options)
        self.dtype: torch.dtype | None = None
        self.dims: Any = None

    def allocate(self, dims: Any, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
        _require_cpu(self, device)
        self.dtype, self.dims = dtype, dims
        tensor, region = self._allocate(dims, dtype, device)
        self._made(region)
        return tensor

    def _made(self, region: Region) -> None:
        """Hook for subclasses that must find their regions without the ledger."""

    @property
    def is_mooncake_compatible(self) -> bool:
        return False

    def free_hugetlb_bytes(self) -> int:
        """Free minus reserved bytes of the hugetlb pool this allocator maps from (0 when
        it does not use hugepages): the credit sglang's admission check gives it."""
        if self.options.hugepages == "off":
            return 0
        pool = kernel.hugepage_pool(self.options.hugepage_size)
        return pool.available * self.options.hugepage_size if pool is not None else 0


class MmapHostTensorAllocator(HostTensorAllocator):
    """sglang's mmap allocator (the same as its base allocator)."""


class ShmHostTensorAllocator(HostTensorAllocator, _hp.ShmHostTensorAllocator):
    """memfd-backed tensors, as sglang's: `fd`/`mm` are the first allocation's."""

    kind = "shm"
    registered_name = "shm"

    def __init__(self, pool: str = DEFAULT_POOL, **options: Any) -> None:
        super().__init__(pool, **options)
        # sglang's __del__ closes the allocator's fds; a finalizer does it here. It holds
        # weak references to the regions, never the allocator, and takes no lock (it may
        # run inside cyclic GC): Region.close() claims the fd atomically and never unmaps
        # under a live view.
        self._region_refs: list[weakref.ref[Region]] = []
        self._fd_closer = weakref.finalize(self, _close_regions, self._region_refs)
        self._fd_closer.atexit = False

    def _made(self, region: Region) -> None:
        refs = self._region_refs
        refs[:] = [r for r in refs if r() is not None]  # released ones need no closing
        refs.append(weakref.ref(region))

    @property
    def fd(self) -> int | None:
        fds = self.fds
        return fds[0] if fds else None

    @property
    def mm(self) -> mmap.mmap | None:
        mms = self.mms
        return mms[0] if mms else None


def _close_regions(refs: list[weakref.ref[Region]]) -> None:
    for ref in refs:
        region = ref()
        if region is not None:
            with contextlib.suppress(OSError):
                region.close()


_ALLOCATORS: dict[str, type[HostTensorAllocator]] = {
    "default": HostTensorAllocator,
    "mmap": MmapHostTensorAllocator,
    "shm": ShmHostTensorAllocator,
}


def _pool_name(name: str) -> str:
    """sglang passes free-text labels; pool names are [A-Za-z0-9_-]{1,64}."""
    cleaned = _POOL_CHARS.sub("_", name)[:64]
    return cleaned or DEFAULT_POOL


def alloc_shm(
    dims: Any, dtype: torch.dtype, name: str = "", **options: Any
) -> tuple[torch.Tensor, int, mmap.mmap]:
    """sglang's `alloc_shm`: (tensor, fd, mm). Close the fd when done; `mm.close()` is
    safe while the tensor lives."""
    options.setdefault("name_prefix", SGLANG_PREFIX)
    return _hp.alloc_shm(dims, dtype, pool=_pool_name(name), **options)


def alloc_mmap(dims: Any, dtype: torch.dtype, name: str = "", **options: Any) -> torch.Tensor:
    """sglang's `alloc_mmap`: a tensor over anonymous memory that owns its mapping."""
    options.setdefault("name_prefix", SGLANG_PREFIX)
    return _hp.alloc_mmap(dims, dtype, pool=_pool_name(name), **options)


def get_allocator_type(server_args: Any) -> str:
    """sglang's rule (`shm`, a dynamic backend asking for shm, the backend name, or
    `default`); a malformed extra config is a ConfigError rather than a silent default."""
    return _hp.get_allocator_type(server_args)


def get_allocator_from_storage(allocator_type: Any = "default") -> _hp.HostTensorAllocator:
    """sglang's factory: an allocator for an allocator type (what `get_allocator_type`
    returns), or for server args. Storage backends give the allocator they declare;
    unknown types fall back to the default allocator with a warning, as sglang does."""
    extra = None
    if isinstance(allocator_type, str) or allocator_type is None:
        name = allocator_type or "default"
    else:
        name = get_allocator_type(allocator_type)
        extra = _field(allocator_type, "hicache_storage_backend_extra_config")
    cls = _ALLOCATORS.get(name)
    if cls is not None:
        return cls()
    try:
        resolved = resolve_allocator(name, extra_config=extra)
    except ConfigError as exc:
        events.warning(
            "hostpool.compat.unknown_allocator",
            allocator_type=name,
            fallback="default",
            error=str(exc),
        )
        return HostTensorAllocator()
    cls = _ALLOCATORS.get(resolved)
    if cls is not None:
        return cls()
    return _hp.create_allocator(resolved, name_prefix=SGLANG_PREFIX)  # a registered one


def _field(server_args: Any, name: str) -> Any:
    if isinstance(server_args, dict):
        return server_args.get(name)
    return getattr(server_args, name, None)


# -- host registration ---------------------------------------------------------------
def host_register_chunk_bytes(
    granularity: int | None = None, *, page_size: int = syscalls.PAGE_SIZE, limit: int | None = None
) -> int:
    """Bytes per cudaHostRegister call: at most `limit` (sglang's
    SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB, at least 1 GiB), a whole number of pages, and
    a whole number of `granularity` units (one copy must not span two registrations)."""
    if limit is None:
        try:
            gib = int(os.environ.get(REGISTER_CHUNK_ENV, "1"))
        except ValueError as exc:
            raise ConfigError(f"{REGISTER_CHUNK_ENV} must be an integer (GiB)") from exc
        limit = max(gib, 1) << 30
    unit = page_size
    if granularity is not None:
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0:
            raise InvalidRequestError(
                f"registration_granularity_bytes must be positive, got {granularity!r}"
            )
        unit = math.lcm(granularity, page_size)
    if unit > limit:
        raise InvalidRequestError(
            f"host registration granularity exceeds the chunk limit: {unit} > {limit} bytes"
        )
    return limit // unit * unit


_pin_lock = threading.Lock()


def alloc_with_host_register(
    dims: Any,
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """sglang's helper: allocate, then cudaHostRegister in chunks when `pin_memory`.

    With a hostpool allocator the pinning is hostpool's own: chunked, rolled back on
    failure, counted in metrics, and unregistered before the memory is unmapped. Other
    allocators get the chunked registration sglang does, ranges kept on the tensor.
    Without CUDA, pinning is skipped (hostpool logs `hostpool.pin_unavailable` once).
    """
    if not pin_memory:
        return allocator.allocate(dims, dtype=dtype, device=device)  # type: ignore[no-any-return]
    chunk = host_register_chunk_bytes(registration_granularity_bytes)
    if isinstance(allocator, _hp.HostTensorAllocator):
        return _allocate_pinned(allocator, dims, dtype, device, chunk)
    buffer: torch.Tensor = allocator.allocate(dims, dtype=dtype, device=device)
    runtime = cuda.get_runtime()
    if runtime.available():
        nbytes = buffer.numel() * buffer.element_size()
        ranges = cuda.pin(runtime, buffer.data_ptr(), nbytes, chunk, syscalls.PAGE_SIZE)
        setattr(buffer, REGISTERED_RANGES_ATTR, ranges)
    return buffer


def _allocate_pinned(
    allocator: _hp.HostTensorAllocator, dims: Any, dtype: torch.dtype, device: str, chunk: int
) -> torch.Tensor:
    # The allocator's options are swapped for this one call, under a lock: host pools
    # are allocated at startup, so serialising pinned allocations costs nothing.
    with _pin_lock:
        saved = allocator.options
        allocator.options = dataclasses.replace(saved, pin=True, pin_chunk_bytes=chunk)
        try:
            return allocator.allocate(dims, dtype, device)
        finally:
            allocator.options = saved


def alloc_with_pin_memory(
    dims: Any,
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any = None,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """sglang's path for devices whose runtime pins itself (NPU, MUSA)."""
    return torch.empty(dims, dtype=dtype, device=device, pin_memory=pin_memory)


AllocFunc = Callable[..., torch.Tensor]
ALLOC_MEMORY_FUNCS: defaultdict[str, AllocFunc] = defaultdict(
    lambda: alloc_with_host_register,
    {"npu": alloc_with_pin_memory, "musa": alloc_with_pin_memory},
)

__all__ = [
    "ALLOC_MEMORY_FUNCS",
    "SGLANG_PREFIX",
    "HostTensorAllocator",
    "MmapHostTensorAllocator",
    "ShmHostTensorAllocator",
    "alloc_mmap",
    "alloc_shm",
    "alloc_with_host_register",
    "alloc_with_pin_memory",
    "get_allocator_from_storage",
    "get_allocator_type",
    "host_register_chunk_bytes",
]
