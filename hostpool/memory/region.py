"""A Region is one allocation: its fd (or none), its mapping, the buffer tensors are built
over, and the facts of how it was made.

Ownership: the only strong chain to a mapping is tensor -> holder -> mmap. The holder is a
ctypes array made by `from_buffer(mm)`: while it lives `mm.close()` raises BufferError, so
nothing can unmap under a live tensor. The Region itself keeps weak references and the
number of its own fd, so dropping the tensors frees the memory.

Two finalizers, neither holding the Region:
- on the holder (the last view died, the mapping is still there): CUDA unregister;
- on the mmap (runs after munmap): close the Region's fd, report the mapping gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from hostpool.errors import AllocationError, HugepageUnavailableError
from hostpool.memory import cuda, kernel, populate, shm, syscalls
from hostpool.memory.options import RegionOptions
from hostpool.memory.units import format_size

Kind = Literal["shm", "mmap", "torch"]
KINDS: tuple[Kind, ...] = ("shm", "mmap", "torch")

# The fixed set of hugepage fallback reasons (label `reason` of
# hostpool_hugepage_fallbacks_total), documented in metrics/README.md.
FALLBACK_REASONS = (
    "hugetlb_pool_short",  # not enough free hugetlb pages of that size (or mmap ENOMEM)
    "hugetlb_unsupported",  # no pool of that size on this host, or the allocator cannot
    "thp_disabled",  # transparent hugepages are off for this kind of memory
    "devshm_no_hugepages",  # the /dev/shm fallback file cannot use hugetlb
)

_region_ids = iter(range(1, 1 << 62))
_region_ids_lock = threading.Lock()


def _next_region_id() -> int:
    with _region_ids_lock:
        return next(_region_ids)


class RegionMapping(mmap.mmap):
    """An mmap whose `close()` never raises and never unmaps under a live view.

    sglang's callers `mm.close()` while tensors still use the pages; here that closes
    nothing until the last view is gone (the mapping then goes with the object).
    """

    _on_close: tuple[list[int], Callable[..., None] | None, int] | None = None

    def close(self) -> None:
        try:
            super().close()
        except BufferError:
            return  # views live: the mapping goes with the last of them
        if self._on_close is not None:
            # Unmapped now by its holder (sglang's `mm.close()`): an explicit release.
            fd_box, on_unmapped, region_id = self._on_close
            self._on_close = None
            _mapping_gone(fd_box, on_unmapped, region_id, "explicit")


@functools.lru_cache(maxsize=512)
def _holder_type(nbytes: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    # A subclass carries a __dict__, so a torch-backed holder can keep its tensor alive.
    return type("RegionBuffer", (ctypes.c_ubyte * nbytes,), {})


def _claim(box: list[int]) -> int | None:
    """Take the fd out of its box exactly once (list.pop is atomic under the GIL)."""
    try:
        return box.pop()
    except IndexError:
        return None


def _mapping_gone(
    fd_box: list[int],
    on_unmapped: Callable[..., None] | None,
    region_id: int,
    how: str = "finalizer",
) -> None:
    # Finalizer: runs after munmap, possibly inside cyclic GC on any thread. It takes no
    # lock and holds no reference to the Region.
    fd = _claim(fd_box)
    if fd is not None:
        os.close(fd)
    if on_unmapped is not None:
        on_unmapped(region_id, how)


def _views_gone(
    chunks: list[tuple[int, int]],
    on_unmapped: Callable[..., None] | None,
    region_id: int,
) -> None:
    # Finalizer on the holder: the mapping still exists, so CUDA can unregister it.
    # An error here has nowhere to go (GC context); unpin already tried every chunk.
    if chunks:
        with contextlib.suppress(Exception):
            cuda.unpin(cuda.get_runtime(), chunks)
    if on_unmapped is not None:
        on_unmapped(region_id)


@dataclass
class Region:
    """One live allocation. Facts are plain values; the mapping is reached weakly."""

    id: int
    pool: str
    kind: Kind
    backend: str  # memfd, devshm, anon, torch
    name: str | None
    requested_bytes: int
    mapped_bytes: int
    page_size: int
    address: int
    populate_mode: str  # madvise, map_populate, touch, none
    populate_seconds: float
    hugepage_fallbacks: tuple[str, ...]
    thp_advised: bool
    seals: int
    numa_node: int | None
    dev_ino: tuple[int, int] | None
    created_at: float = field(default_factory=time.time)
    pinned_chunks: list[tuple[int, int]] = field(default_factory=list, repr=False)
    _fd_box: list[int] = field(default_factory=list, repr=False)
    _mm_ref: weakref.ReferenceType[RegionMapping] | None = field(default=None, repr=False)
    _holder_ref: weakref.ReferenceType[Any] | None = field(default=None, repr=False)
    _finalizers: list[weakref.finalize[Any, Any]] = field(default_factory=list, repr=False)

    @property
    def fd(self) -> int | None:
        """The Region's own fd while it holds one. Verify `dev_ino` before trusting it."""
        box = self._fd_box
        return box[0] if box else None

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self.pinned_chunks)

    @property
    def mapped(self) -> bool:
        """Whether the mapping still exists (some view, or an mmap object, holds it)."""
        if self._mm_ref is not None:
            mm = self._mm_ref()
            return mm is not None and not mm.closed
        return self._holder_ref is not None and self._holder_ref() is not None

    def views_alive(self) -> bool:
        return self._holder_ref is not None and self._holder_ref() is not None

    def mmap(self) -> RegionMapping | None:
        """The mmap object, while it exists (strong reference for the caller)."""
        return self._mm_ref() if self._mm_ref is not None else None

    def open_fd_count(self) -> int:
        """fds the process holds for this region: its own, plus mmap's internal dup."""
        own = 1 if self._fd_box else 0
        mm = self.mmap()
        dup = 1 if (self.dev_ino is not None and mm is not None and not mm.closed) else 0
        return own + dup

    def borrow_fd(self) -> int | None:
        """A dup of the Region's fd, verified to be the same inode, or None once released.

        fd numbers are reused by the kernel: nothing acts on a bare number after the
        Region may have closed it. The caller closes the dup.
        """
        fd = self.fd
        if fd is None or self.dev_ino is None:
            return None
        try:
            dup = os.dup(fd)
        except OSError:
            return None
        st = os.fstat(dup)
        if (st.st_dev, st.st_ino) != self.dev_ino:
            os.close(dup)
            return None
        return dup

    def resident_bytes(self) -> int:
        """Bytes of this region backed by memory now.

        fd-backed: `fstat().st_blocks` (~3 us at any size, hugetlb included); anonymous:
        `mincore` (~5 ms per 4 GiB) while a strong reference keeps the range mapped.
        """
        fd = self.fd
        if self.dev_ino is not None and fd is not None:
            try:
                st = os.fstat(fd)
            except OSError:
                return 0
            if (st.st_dev, st.st_ino) != self.dev_ino:
                return 0  # released meanwhile; the number now names another file
            return min(self.mapped_bytes, st.st_blocks * 512)
        keep = self.mmap() if self._mm_ref is not None else None
        if keep is None:
            keep = self._holder_ref() if self._holder_ref is not None else None
        if keep is None:
            return 0
        try:
            start = self.address & ~(syscalls.PAGE_SIZE - 1)
            length = self.address + self.mapped_bytes - start
            pages = syscalls.mincore_resident_pages(start, length)
        except OSError:
            return 0
        finally:
            del keep
        return min(self.mapped_bytes, pages * syscalls.PAGE_SIZE)

    def scrape(self) -> tuple[int, int]:
        """(open fds, resident bytes) in one pass: what a scrape needs, as cheaply as it can.

        One fstat per fd-backed region (verified against `dev_ino`: the number may name
        another file once released); mincore for anonymous ones.
        """
        mm_ref = self._mm_ref
        mm = mm_ref() if mm_ref is not None else None
        if self.dev_ino is None:
            return 0, self.resident_bytes()
        dup = 1 if (mm is not None and not mm.closed) else 0
        box = self._fd_box
        if not box:
            return dup, 0
        try:
            st = os.fstat(box[0])
        except (OSError, IndexError):
            return dup, 0
        if (st.st_dev, st.st_ino) != self.dev_ino:
            return dup, 0
        blocks = st.st_blocks * 512
        return 1 + dup, blocks if blocks < self.mapped_bytes else self.mapped_bytes

    def close(self) -> bool:
        """Release the Region's own fd and unmap if no view lives. Idempotent.

        Returns True when the mapping is gone now; False when live views still hold it
        ("released, still mapped"): it goes with the last view, never under it.
        """
        fd = _claim(self._fd_box)
        if fd is not None:
            os.close(fd)
        mm = self.mmap()
        if mm is not None:
            try:
                mmap.mmap.close(mm)
            except BufferError:
                return False
            return True
        return not self.views_alive()

    def detach_finalizers(self) -> None:
        for fin in self._finalizers:
            fin.detach()


@dataclass(frozen=True)
class _HugepagePlan:
    hugetlb_size: int | None
    thp: bool
    fallbacks: tuple[str, ...]


def _required_message(size: int, need_pages: int, pool: kernel.HugepagePool | None) -> str:
    label = format_size(size)
    sysdir = f"/sys/kernel/mm/hugepages/hugepages-{size // 1024}kB/nr_hugepages"
    if pool is None:
        return (
            f"hugepages='required' with {label} pages, but this host has no {label} hugetlb "
            f"pool ({sysdir} is missing); use a size the host has or hugepages='prefer'"
        )
    want = pool.total + need_pages - pool.available
    return (
        f"hugepages='required': need {need_pages} pages of {label}, {pool.available} free "
        f"(free {pool.free} minus reserved {pool.reserved}); reserve more with "
        f"`echo {want} > {sysdir}`"
        + (" (or `sysctl -w vm.nr_hugepages=" + str(want) + "`)" if size == 2 << 20 else "")
    )


def plan_hugepages(
    kind: Kind,
    backend: str,
    nbytes: int,
    options: RegionOptions,
    *,
    hugetlb_failed: bool = False,
) -> _HugepagePlan:
    """Decide hugetlb, THP or normal pages, with the reason for each fallback.

    The same code answers `hostpool doctor`'s "what would auto choose".
    """
    if options.hugepages == "off":
        return _HugepagePlan(None, False, ())
    size = options.hugepage_size
    need = -(-max(nbytes, 1) // size)
    reason: str | None = None
    pool = None
    if kind == "torch":
        reason = "hugetlb_unsupported"
    elif backend == "devshm":
        reason = "devshm_no_hugepages"
    else:
        pool = kernel.hugepage_pool(size)
        if pool is None:
            reason = "hugetlb_unsupported"
        elif hugetlb_failed or pool.available < need:
            reason = "hugetlb_pool_short"
    if reason is None:
        return _HugepagePlan(size, False, ())
    if options.hugepages == "required":
        if reason == "hugetlb_pool_short" or (reason == "hugetlb_unsupported" and kind != "torch"):
            raise HugepageUnavailableError(_required_message(size, need, pool))
        raise HugepageUnavailableError(
            f"hugepages='required' cannot be met by the {kind} allocator on {backend}: "
            f"{reason}; use the shm or mmap allocator with memfd"
        )
    return _thp_plan((reason,), kind)


def _thp_plan(fallbacks: tuple[str, ...], kind: Kind) -> _HugepagePlan:
    allowed = kernel.shmem_thp_allowed() if kind == "shm" else kernel.anon_thp_allowed()
    if kind != "torch" and allowed:
        return _HugepagePlan(None, True, fallbacks)
    return _HugepagePlan(None, False, (*fallbacks, "thp_disabled"))


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


def _choose_populate(requested: str, fd_backed: bool) -> str:
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
    kind: Kind,
    pool: str,
    options: RegionOptions,
    on_unmapped: Callable[..., None] | None = None,
    hugetlb_failed: bool = False,
) -> tuple[Region, Any]:
    """Map, size, seal, bind, populate and (optionally) pin `nbytes` of host memory.

    Returns the Region and its buffer holder: build tensors over the holder with
    `tensor_over`, and drop it; the Region keeps only weak references.
    Every failure closes what it opened before raising: no fd, mapping or pin is left.
    `on_unmapped(region_id)` is called once, from a finalizer, when the mapping is gone; it must not
    reference the Region and must not take locks.
    """
    b = _Builder()
    try:
        return _create(b, nbytes, kind, pool, options, on_unmapped, hugetlb_failed)
    except BaseException as exc:
        b.abort()
        if isinstance(exc, OSError):
            raise populate.failure_from_oserror(exc, f"allocating {nbytes} bytes", nbytes) from exc
        raise


def _create(
    b: _Builder,
    nbytes: int,
    kind: Kind,
    pool: str,
    options: RegionOptions,
    on_unmapped: Callable[..., None] | None,
    hugetlb_failed: bool,
) -> tuple[Region, Any]:
    backend = {"shm": "memfd", "mmap": "anon", "torch": "torch"}[kind]
    if kind == "shm" and options.shm_backend == "devshm":
        backend = "devshm"
    plan = plan_hugepages(kind, backend, nbytes, options, hugetlb_failed=hugetlb_failed)
    page_size = plan.hugetlb_size or syscalls.PAGE_SIZE
    fallbacks = plan.fallbacks
    name: str | None = None
    seals = 0
    dev_ino: tuple[int, int] | None = None
    if kind == "torch":
        return _create_torch(b, nbytes, pool, options, plan, on_unmapped)

    populate_mode = _choose_populate(options.populate, fd_backed=kind == "shm")
    mapped = _round_up(nbytes, page_size)
    map_flags = mmap.MAP_SHARED if kind == "shm" else mmap.MAP_PRIVATE
    if populate_mode == "map_populate":
        map_flags |= syscalls.MAP_POPULATE

    if kind == "shm":
        shm_file, backend = _open_shm(pool, options, plan.hugetlb_size)
        b.fd = shm_file.fd
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
        try:
            b.mm = RegionMapping(b.fd, mapped, flags=map_flags)
        except OSError as exc:
            if plan.hugetlb_size is None or exc.errno != errno.ENOMEM:
                raise
            if options.hugepages == "required":
                pool_now = kernel.hugepage_pool(plan.hugetlb_size)
                raise HugepageUnavailableError(
                    _required_message(plan.hugetlb_size, mapped // plan.hugetlb_size, pool_now)
                ) from exc
            # prefer: the pool (or a hugetlb cgroup limit) was short at mmap time.
            b.abort()
            return _retry_without_hugetlb(nbytes, kind, pool, options, on_unmapped)
    else:
        flags = map_flags
        if plan.hugetlb_size is not None:
            flags |= syscalls.MAP_HUGETLB | (
                (plan.hugetlb_size.bit_length() - 1) << syscalls.MAP_HUGE_SHIFT
            )
        try:
            b.mm = RegionMapping(-1, mapped, flags=flags)
        except OSError as exc:
            if plan.hugetlb_size is None or exc.errno != errno.ENOMEM:
                raise
            if options.hugepages == "required":
                raise HugepageUnavailableError(
                    _required_message(
                        plan.hugetlb_size,
                        mapped // plan.hugetlb_size,
                        kernel.hugepage_pool(plan.hugetlb_size),
                    )
                ) from exc
            b.abort()
            return _retry_without_hugetlb(nbytes, kind, pool, options, on_unmapped)

    holder_type = _holder_type(mapped)
    b.holder = holder_type.from_buffer(b.mm)
    address = ctypes.addressof(b.holder)
    if kind == "mmap":
        name = f"{options.name_prefix}{pool}.{os.getpid()}"
        if not syscalls.name_anonymous_mapping(address, mapped, name):
            name = None
    if options.numa_node is not None:
        syscalls.mbind(address, mapped, options.numa_node)  # before any page is faulted
    if plan.thp:
        syscalls.madvise(address, mapped, syscalls.MADV_HUGEPAGE)
    t_pop = time.perf_counter()
    used = _populate(b, populate_mode, address, mapped, page_size, options)
    populate_seconds = time.perf_counter() - t_pop
    if options.pin:
        b.chunks = _pin(address, mapped, options, page_size)

    fd_box = [b.fd] if b.fd is not None else []
    region = Region(
        id=_next_region_id(),
        pool=pool,
        kind=kind,
        backend=backend,
        name=name,
        requested_bytes=nbytes,
        mapped_bytes=mapped,
        page_size=page_size,
        address=address,
        populate_mode=used,
        populate_seconds=populate_seconds,
        hugepage_fallbacks=fallbacks,
        thp_advised=plan.thp,
        seals=seals,
        numa_node=options.numa_node,
        dev_ino=dev_ino,
        pinned_chunks=b.chunks,
        _fd_box=fd_box,
        _mm_ref=weakref.ref(b.mm),
        _holder_ref=weakref.ref(b.holder),
    )
    on_views_gone = weakref.finalize(b.holder, _views_gone, b.chunks, None, region.id)
    on_gone = weakref.finalize(b.mm, _mapping_gone, fd_box, on_unmapped, region.id)
    b.mm._on_close = (fd_box, on_unmapped, region.id)
    for fin in (on_views_gone, on_gone):
        fin.atexit = False
    region._finalizers = [on_views_gone, on_gone]
    holder = b.holder
    # Ownership passes to the holder: drop the builder's strong references.
    b.fd = None
    b.mm = None
    b.holder = None
    b.chunks = []
    return region, holder


def _retry_without_hugetlb(
    nbytes: int,
    kind: Kind,
    pool: str,
    options: RegionOptions,
    on_unmapped: Callable[..., None] | None,
) -> tuple[Region, Any]:
    """`prefer` after hugetlb mmap failed with ENOMEM (a race, or a hugetlb cgroup limit)."""
    return create_region(
        nbytes,
        kind=kind,
        pool=pool,
        options=options,
        on_unmapped=on_unmapped,
        hugetlb_failed=True,
    )


def tensor_over(holder: Any, dims: tuple[int, ...], dtype: Any) -> Any:
    """A tensor of `dims`/`dtype` over a Region's holder (the tensor keeps it alive)."""
    import math

    import torch

    count = math.prod(dims)
    if count == 0:
        return torch.frombuffer(holder, dtype=dtype, count=1)[:0].reshape(dims)
    return torch.frombuffer(holder, dtype=dtype, count=count).reshape(dims)


def _create_torch(
    b: _Builder,
    nbytes: int,
    pool: str,
    options: RegionOptions,
    plan: _HugepagePlan,
    on_unmapped: Callable[..., None] | None,
) -> tuple[Region, Any]:
    import torch

    mapped = max(nbytes, 1)
    b.torch_tensor = torch.empty(mapped, dtype=torch.uint8)
    address = int(b.torch_tensor.data_ptr())
    holder = _holder_type(mapped).from_address(address)
    holder._owner = b.torch_tensor  # type: ignore[attr-defined]  # keeps torch's storage alive
    b.holder = holder
    t_pop = time.perf_counter()
    mode = options.populate
    if mode == "auto":
        mode = "touch"
    if mode in ("touch", "madvise", "map_populate"):
        # torch's memory is malloc'd: zero_() (multi-threaded) is the way to fault it in.
        b.torch_tensor.zero_()
        mode = "touch"
    populate_seconds = time.perf_counter() - t_pop
    if options.pin:
        b.chunks = _pin(address, mapped, options, syscalls.PAGE_SIZE)
    region = Region(
        id=_next_region_id(),
        pool=pool,
        kind="torch",
        backend="torch",
        name=None,
        requested_bytes=nbytes,
        mapped_bytes=mapped,
        page_size=syscalls.PAGE_SIZE,
        address=address,
        populate_mode=mode,
        populate_seconds=populate_seconds,
        hugepage_fallbacks=plan.fallbacks,
        thp_advised=False,
        seals=0,
        numa_node=None,
        dev_ino=None,
        pinned_chunks=b.chunks,
        _holder_ref=weakref.ref(holder),
    )
    fin = weakref.finalize(holder, _views_gone, b.chunks, on_unmapped, region.id)
    fin.atexit = False
    region._finalizers = [fin]
    b.torch_tensor = None
    b.holder = None
    b.chunks = []
    return region, holder
