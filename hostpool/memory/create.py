"""Building a Region: open, size, seal, map, bind, populate, pin, in that order.

Every failure closes what it opened, in reverse, before raising: no fd, mapping or pin
is left behind, and an OSError becomes an AllocationError with a reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

from hostpool._lazy import require_torch
from hostpool.errors import AllocationError, HugepageUnavailableError
from hostpool.memory import cuda, kernel, populate, shm, syscalls
from hostpool.memory.holders import holder_over_tensor, holder_type, region_over
from hostpool.memory.hugepages import HugepagePlan, plan_hugepages, required_message
from hostpool.memory.options import RegionOptions
from hostpool.memory.region import Region, RegionMapping
from hostpool.words import AllocatorKind


def _pin(
    address: int, length: int, options: RegionOptions, page_size: int
) -> list[tuple[int, int]]:
    """cudaHostRegister in chunks (rolled back on failure); [] where CUDA is absent."""
    runtime = cuda.get_runtime()
    if not runtime.available():
        return []
    try:
        return cuda.pin(runtime, address, length, options.pin_chunk_bytes, page_size)
    except RuntimeError as exc:
        raise AllocationError(
            f"pinning {length} bytes with cudaHostRegister failed ({exc}); every chunk "
            "registered before it was unregistered. Check RLIMIT_MEMLOCK and GPU state",
            reason="other",
        ) from exc


def _round_up(n: int, unit: int) -> int:
    return -(-max(n, 1) // unit) * unit


def _open_shm(
    pool: str, options: RegionOptions, hugetlb_size: int | None
) -> tuple[shm.ShmFile, str]:
    name = shm.next_name(options.name_prefix, pool)
    if options.shm_backend == "devshm":
        return shm.create_devshm(name, options.fallback_dir), "devshm"
    try:
        return shm.create_memfd(name, hugetlb_page_size=hugetlb_size), "memfd"
    except OSError as exc:
        if options.shm_backend == "memfd" or exc.errno in (
            errno.EMFILE,
            errno.ENFILE,
            errno.ENOMEM,
        ):
            raise
        if hugetlb_size is not None:
            raise
        return shm.create_devshm(name, options.fallback_dir), "devshm"


class _Builder:
    """Everything opened while building a Region, closed in reverse on any failure."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.mm: RegionMapping | None = None
        self.holder: Any = None
        self.chunks: list[tuple[int, int]] = []
        self.torch_tensor: Any = None
        self.backend = ""

    def abort(self) -> None:
        if self.chunks:
            with contextlib.suppress(Exception):
                cuda.unpin(cuda.get_runtime(), self.chunks)
        self.holder = None
        self.torch_tensor = None
        if self.mm is not None:
            mmap.mmap.close(self.mm)
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def finish(self, on_unmapped: Callable[..., None] | None, **facts: Any) -> tuple[Region, Any]:
        """(the Region over what was built, its holder), with `facts`: the `RegionFacts`
        fields the maker knows. Ownership passes to the holder and the Region: the builder
        drops its strong references."""
        region = region_over(
            self.holder,
            on_unmapped,
            mapping=self.mm,
            fd=self.fd,
            pinned_chunks=self.chunks,
            **facts,
        )
        holder = self.holder
        self.fd = self.mm = self.holder = self.torch_tensor = None
        self.chunks = []
        return region, holder


def _populate(
    b: _Builder,
    mode: str,
    address: int,
    length: int,
    page_size: int,
    options: RegionOptions,
) -> str:
    """Populate the mapping per `mode`; returns the mode actually used."""
    if mode == "none":
        return "none"
    if mode == "map_populate":
        # Only anonymous mappings get here after mmap(MAP_POPULATE): verify, never trust.
        if b.fd is not None:
            populate.check_fd_resident(b.fd, length)
        elif syscalls.mincore_resident_pages(address, length) * syscalls.PAGE_SIZE < length:
            raise AllocationError("MAP_POPULATE left pages unbacked", reason="no_memory")
        return "map_populate"
    if mode == "touch":
        populate.touch(address, length, page_size=page_size)
        return "touch"
    populate.madvise_populate(
        address, length, page_size=page_size, threads=options.effective_populate_threads()
    )
    return "madvise"


def choose_populate(requested: str, fd_backed: bool) -> str:
    """`auto` -> madvise where the kernel has MADV_POPULATE_WRITE, else the fallback."""
    if requested != "auto":
        if requested == "madvise" and not kernel.probe_madv_populate_write():
            raise AllocationError(
                "populate='madvise' needs MADV_POPULATE_WRITE (Linux 5.14+); this kernel "
                "lacks it: use populate='auto'",
                reason="invalid",
            )
        return requested
    if kernel.probe_madv_populate_write():
        return "madvise"
    return "map_populate" if fd_backed else "touch"


def create_region(
    nbytes: int,
    *,
    kind: AllocatorKind,
    pool: str,
    options: RegionOptions,
    on_unmapped: Callable[..., None] | None = None,
    plan: HugepagePlan | None = None,
) -> tuple[Region, Any]:
    """Map, size, seal, bind, populate and (optionally) pin `nbytes` of host memory.

    Returns the Region and its buffer holder: build tensors over the holder with
    `tensor_over`, and drop it; the Region keeps only weak references.
    `plan` is the caller's hugepage plan (the one its admission reserved for); hugetlb
    mmap short of pages raises AllocationError(reason="hugepages") and the caller, having
    admitted the fallback, calls again with `plan_fallback(...)`'s plan: nothing here
    maps memory that was not admitted.
    Every failure closes what it opened before raising: no fd, mapping or pin is left.
    `on_unmapped(region_id)` is called once, from a finalizer, when the mapping is gone; it must not
    reference the Region and must not take locks.
    """
    b = _Builder()
    if plan is None:
        plan = plan_hugepages(kind, backend_of(kind, options), nbytes, options)
    try:
        return _create(b, nbytes, kind, pool, options, on_unmapped, plan)
    except BaseException as exc:
        full = isinstance(exc, OSError) and _tmpfs_full(b, nbytes)
        b.abort()
        if full:
            raise AllocationError(
                f"allocating {nbytes} bytes: the backing tmpfs is full "
                f"({errno.errorcode.get(getattr(exc, 'errno', 0) or 0, exc)} from populate); "
                "enlarge it (e.g. docker --shm-size) or use the memfd backend",
                reason="no_space",
            ) from exc
        if isinstance(exc, OSError):
            raise kernel.failure_from_oserror(exc, f"allocating {nbytes} bytes", nbytes) from exc
        raise


def backend_of(kind: AllocatorKind, options: RegionOptions) -> str:
    """The backend a request of this kind maps (memfd may still fall back to devshm)."""
    if kind == "shm":
        return "devshm" if options.shm_backend == "devshm" else "memfd"
    return {"mmap": "anon", "torch": "torch"}[kind]


def plan_fallback(kind: AllocatorKind, nbytes: int, options: RegionOptions) -> HugepagePlan:
    """The plan after hugetlb was short at mmap time (or refused by its admission)."""
    return plan_hugepages(kind, backend_of(kind, options), nbytes, options, hugetlb_failed=True)


def _tmpfs_full(b: _Builder, nbytes: int) -> bool:
    """Whether a file-backed failure was the tmpfs running out of space (populate reports
    EFAULT there, which would otherwise read as a shortage of RAM)."""
    if b.fd is None or b.backend != "devshm":
        return False
    try:
        st = os.fstatvfs(b.fd)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _round_up(nbytes, syscalls.PAGE_SIZE)


def _create(
    b: _Builder,
    nbytes: int,
    kind: AllocatorKind,
    pool: str,
    options: RegionOptions,
    on_unmapped: Callable[..., None] | None,
    plan: HugepagePlan,
) -> tuple[Region, Any]:
    backend = backend_of(kind, options)
    page_size = plan.hugetlb_size or syscalls.PAGE_SIZE
    fallbacks = plan.fallbacks
    name: str | None = None
    seals = 0
    dev_ino: tuple[int, int] | None = None
    if kind == "torch":
        return _create_torch(b, nbytes, pool, options, plan, on_unmapped)

    populate_mode = choose_populate(options.populate, fd_backed=kind == "shm")
    mapped = _round_up(nbytes, page_size)
    map_flags = mmap.MAP_SHARED if kind == "shm" else mmap.MAP_PRIVATE
    if populate_mode == "map_populate":
        map_flags |= syscalls.MAP_POPULATE

    if kind == "shm":
        shm_file, backend = _open_shm(pool, options, plan.hugetlb_size)
        b.fd = shm_file.fd
        b.backend = backend
        name = shm_file.name
        if backend == "devshm" and plan.hugetlb_size is not None:
            raise AssertionError("unreachable: hugetlb planned on devshm")
        seals = shm.size_and_seal(shm_file, mapped, seal=options.seal)
        st = os.fstat(b.fd)
        dev_ino = (st.st_dev, st.st_ino)
        if populate_mode in ("map_populate", "touch"):
            # tmpfs and hugetlbfs back the whole file now: ENOSPC/ENOMEM here is clean,
            # where a touch past the space would be a SIGBUS.
            populate.fallocate_all(b.fd, mapped)
        b.mm = _map(b.fd, mapped, map_flags, plan, options)
        if seals and shm_file.hugetlb_page_size is not None:
            # Against hole punching, now that our writable mapping exists (the seal
            # refuses new writable mappings; ours stays writable): see shm.seal_mapped.
            seals = shm.seal_mapped(shm_file)
    else:
        flags = map_flags
        if plan.hugetlb_size is not None:
            flags |= syscalls.MAP_HUGETLB | (
                (plan.hugetlb_size.bit_length() - 1) << syscalls.MAP_HUGE_SHIFT
            )
        b.mm = _map(-1, mapped, flags, plan, options)

    b.holder = holder_type(mapped).from_buffer(b.mm)
    address = ctypes.addressof(b.holder)
    if kind == "mmap":
        name = f"{options.name_prefix}{pool}.{os.getpid()}"
        if not syscalls.name_anonymous_mapping(address, mapped, name):
            name = None
    if options.numa_node is not None:
        syscalls.mbind(address, mapped, options.numa_node)  # before any page is faulted
    if plan.thp:
        syscalls.madvise(address, mapped, syscalls.MADV_HUGEPAGE)
    elif plan.thp_avoid:
        syscalls.madvise(address, mapped, syscalls.MADV_NOHUGEPAGE)
    t_pop = time.perf_counter()
    used = _populate(b, populate_mode, address, mapped, page_size, options)
    seconds = time.perf_counter() - t_pop
    if options.pin:
        b.chunks = _pin(address, mapped, options, page_size)

    return b.finish(
        on_unmapped,
        pool=pool,
        kind=kind,
        backend=backend,
        requested_bytes=nbytes,
        page_size=page_size,
        name=name,
        populate_mode=used,
        populate_seconds=seconds,
        hugepage_fallbacks=fallbacks,
        thp_advised=plan.thp,
        seals=seals,
        numa_node=options.numa_node,
        dev_ino=dev_ino,
    )


def _map(
    fd: int, length: int, flags: int, plan: HugepagePlan, options: RegionOptions
) -> RegionMapping:
    """mmap; hugetlb short of pages at this moment (a race, or a hugetlb cgroup limit)
    is a typed `hugepages` error the caller falls back from, with admission."""
    try:
        return RegionMapping(fd, length, flags=flags)
    except OSError as exc:
        if plan.hugetlb_size is None or exc.errno != errno.ENOMEM:
            raise
        pages = length // plan.hugetlb_size
        message = required_message(
            plan.hugetlb_size, pages, kernel.hugepage_pool(plan.hugetlb_size)
        )
        if options.hugepages == "required":
            raise HugepageUnavailableError(message) from exc
        raise AllocationError(
            f"hugetlb mmap failed (ENOMEM): {message}", reason="hugepages"
        ) from exc


def _create_torch(
    b: _Builder,
    nbytes: int,
    pool: str,
    options: RegionOptions,
    plan: HugepagePlan,
    on_unmapped: Callable[..., None] | None,
) -> tuple[Region, Any]:
    torch = require_torch("the `torch` allocator kind (`default`: torch.empty memory)")
    mapped = max(nbytes, 1)
    b.torch_tensor = torch.empty(mapped, dtype=torch.uint8)
    b.holder = holder = holder_over_tensor(b.torch_tensor, mapped)
    t_pop = time.perf_counter()
    mode = options.populate
    if mode == "auto":
        mode = "touch"
    if mode in ("touch", "madvise", "map_populate"):
        # torch's memory is malloc'd: zero_() (multi-threaded) is the way to fault it in.
        b.torch_tensor.zero_()
        mode = "touch"
    seconds = time.perf_counter() - t_pop
    if options.pin:
        b.chunks = _pin(ctypes.addressof(holder), mapped, options, syscalls.PAGE_SIZE)
    return b.finish(
        on_unmapped,
        pool=pool,
        kind="torch",
        backend="torch",
        requested_bytes=nbytes,
        populate_mode=mode,
        populate_seconds=seconds,
        hugepage_fallbacks=plan.fallbacks,
    )
