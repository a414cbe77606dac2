"""A Region is one allocation: its fd (or none), its mapping, the buffer tensors are built
over, and the facts of how it was made.

Ownership: the only strong chain to a mapping is tensor -> holder -> mmap. The holder is a
ctypes array made by `from_buffer(mm)`: while it lives `mm.close()` raises BufferError, so
nothing can unmap under a live tensor. The Region itself keeps weak references and the
number of its own fd, so dropping the tensors frees the memory.

Two finalizers, neither holding the Region:
- on the holder (the last view died, the mapping is still there): CUDA unregister;
- on the mmap (runs after munmap): close the Region's fd, report the mapping gone.

`on_unmapped(region_id, cause="collected", reused_fd=None, still_mapped=False)` is how
the memory layer reports an end (`hostpool.words.EndCause`: `explicit` or `collected`);
the ledger, which knows who owned the region, decides what a collection was (`tensor` or
the leak signal, `finalizer`).

Measuring holds nothing. `scrape()`, `resident_bytes()`, `open_fd_count()`, `mapped` and
`views_alive()` run on any thread (the collector's, a publisher's) while the owner releases
the region and drops its last view. They never take a strong reference to the mmap or the
holder: one held across an fstat or a mincore could outlive the owner's last view, and the
mapping would then stay in the measurer's hands, "released, still mapped" (a leak report,
the gauge, a release counted `explicit` instead of `tensor`), until the measurement ended.
They ask weak proxies instead: an attribute read through a proxy holds the object only
inside one C call under the GIL, so it can never be the last reference. A mincore over an
anonymous range is trusted only if the mapping is still there after it (an mmap object
whose refcount reached zero, or that was closed, is never mapped again): a range that went
away meanwhile counts 0 (ENOMEM, or another mapping's pages since), never touched.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hostpool.base.locks import ForkSafeLock
from hostpool.memory import cuda, syscalls
from hostpool.memory.interface import RegionFacts, RegionLike
from hostpool.words import EndCause

_region_ids = iter(range(1, 1 << 62))
_region_ids_lock = ForkSafeLock()


def _next_region_id() -> int:
    with _region_ids_lock:
        return next(_region_ids)


def new_region(
    holder: Any,
    on_unmapped: Callable[..., None] | None,
    *,
    mapping: RegionMapping | None = None,
    fd: int | None = None,
    pinned_chunks: list[tuple[int, int]] | None = None,
    **facts: Any,
) -> Region:
    """The Region over `holder` (the object tensors are built over), with a fresh id and
    its finalizers; the one way regions are made.

    `mapping`: the RegionMapping the holder was made from (`from_buffer`), whose end
    closes `fd` (the region's own, now owned by the Region) and reports the region gone;
    without one, the holder's end reports it gone. `pinned_chunks`: the ranges registered
    with CUDA, unregistered when the last view dies (the list is the Region's from now
    on). `facts`: the `RegionFacts` fields but `id` (pool, kind, backend, bytes,
    populate...); an unknown one raises TypeError. `on_unmapped` is the ledger's callback
    (see the module doc), or None.
    """
    chunks = pinned_chunks if pinned_chunks is not None else []
    fd_box = [fd] if fd is not None else []
    region = Region(
        facts=RegionFacts(id=_next_region_id(), **facts),
        pinned_chunks=chunks,
        _fd_box=fd_box,
        _mm_ref=weakref.ref(mapping) if mapping is not None else None,
        _holder_ref=weakref.ref(holder),
    )
    finalizers: list[weakref.finalize[Any, Any]]
    if mapping is None:
        finalizers = [weakref.finalize(holder, _views_gone, chunks, on_unmapped, region.facts.id)]
    else:
        dev_ino = region.facts.dev_ino
        finalizers = [
            weakref.finalize(holder, _views_gone, chunks, None, region.facts.id),
            weakref.finalize(
                mapping, _mapping_gone, fd_box, on_unmapped, region.facts.id, "collected", dev_ino
            ),
        ]
        mapping._on_close = (fd_box, on_unmapped, region.facts.id, dev_ino)
    for finalizer in finalizers:
        finalizer.atexit = False
    region._finalizers = finalizers
    return region


class RegionMapping(mmap.mmap):
    """An mmap whose `close()` is an explicit release that never unmaps under a live view.

    sglang's callers `mm.close()` while tensors still use the pages. That is the holder
    releasing the region: reported at once (`explicit`, with the region's own fd closed),
    and the pages go with the last view ("released, still mapped"), never under it.
    """

    _on_close: tuple[list[int], Callable[..., None] | None, int, tuple[int, int] | None] | None = (
        None
    )

    def close(self) -> None:
        try:
            super().close()
        except BufferError:
            self._released(still_mapped=True)  # views live: unmapped with the last of them
            return
        self._released(still_mapped=False)

    def _released(self, *, still_mapped: bool) -> None:
        if self._on_close is None:
            return  # reported once; a second close() is a no-op
        fd_box, on_unmapped, region_id, dev_ino = self._on_close
        self._on_close = None
        if not still_mapped:
            _mapping_gone(fd_box, on_unmapped, region_id, "explicit", dev_ino)
            return
        fd = _claim(fd_box)
        reused = fd if fd is not None and not close_if_same(fd, dev_ino) else None
        if on_unmapped is not None:
            on_unmapped(region_id, "explicit", reused, True)


def _claim(box: list[int]) -> int | None:
    """Take the fd out of its box exactly once (list.pop is atomic under the GIL)."""
    try:
        return box.pop()
    except IndexError:
        return None


def close_if_same(fd: int, dev_ino: tuple[int, int] | None) -> bool:
    """Close `fd` only if it still names the inode `dev_ino`; False when it does not.

    The number left hostpool's hands (`.fd`, `.fds`): a caller may have closed it and the
    kernel handed it to an unrelated file, which must not be closed here.
    """
    if dev_ino is not None:
        try:
            st = os.fstat(fd)
        except OSError:
            return False  # closed by someone else: nothing of ours to close
        if (st.st_dev, st.st_ino) != dev_ino:
            return False
    os.close(fd)
    return True


def dup_if_same(fd: int, dev_ino: tuple[int, int]) -> int | None:
    """A dup of `fd` if it (still) names the inode `dev_ino`, else None (closed, or its
    number names another file now); the caller closes the dup. Raises OSError other than
    EBADF (out of fds: EMFILE, ENFILE)."""
    try:
        dup = os.dup(fd)
    except OSError as exc:
        if exc.errno == errno.EBADF:  # closed since the number was read
            return None
        raise
    st = os.fstat(dup)
    if (st.st_dev, st.st_ino) != dev_ino:
        os.close(dup)
        return None
    return dup


def _mapping_gone(
    fd_box: list[int],
    on_unmapped: Callable[..., None] | None,
    region_id: int,
    how: EndCause = "collected",
    dev_ino: tuple[int, int] | None = None,
) -> None:
    # Finalizer: runs after munmap, possibly inside cyclic GC on any thread. It takes no
    # lock and holds no reference to the Region.
    fd = _claim(fd_box)
    reused = fd is not None and not close_if_same(fd, dev_ino)
    if on_unmapped is not None:
        if reused:
            on_unmapped(region_id, how, fd)
        else:
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


def _mapping_open(proxy: Any) -> bool:
    """Whether the mmap behind a weak proxy still maps its range, taking no reference.

    `closed` is mmap's C getter: the proxy holds the object only inside that call, under
    the GIL. The proxy is dead once the refcount reached zero, before the dealloc unmaps.
    """
    if proxy is None:
        return False
    try:
        return not proxy.closed
    except ReferenceError:
        return False


def _holder_alive(proxy: Any) -> bool:
    """Whether the holder behind a weak proxy lives (its views, and so its memory), taking
    no reference (`len` of a ctypes array is one C call under the GIL)."""
    if proxy is None:
        return False
    try:
        len(proxy)
    except ReferenceError:
        return False
    return True


@dataclass
class Region:
    """One live allocation: the facts of its birth (`RegionFacts`), its fd, and its
    mapping, reached weakly."""

    facts: RegionFacts
    pinned_chunks: list[tuple[int, int]] = field(default_factory=list, repr=False)
    _fd_box: list[int] = field(default_factory=list, repr=False)
    _mm_ref: weakref.ReferenceType[RegionMapping] | None = field(default=None, repr=False)
    _holder_ref: weakref.ReferenceType[Any] | None = field(default=None, repr=False)
    _finalizers: list[weakref.finalize[Any, Any]] = field(default_factory=list, repr=False)
    # The number of an fd we did not close because it named another file by then.
    fd_reused: int | None = field(default=None, repr=False)
    # Weak proxies of the mmap and the holder: what measuring asks (see the module doc).
    _mm_proxy: Any = field(default=None, init=False, repr=False, compare=False)
    _holder_proxy: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The builder holds both objects now: reading the refs here cannot be the last
        # reference to either.
        mm = self._mm_ref() if self._mm_ref is not None else None
        if mm is not None:
            self._mm_proxy = weakref.proxy(mm)
        holder = self._holder_ref() if self._holder_ref is not None else None
        if holder is not None:
            self._holder_proxy = weakref.proxy(holder)

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
        """Whether the mapping still exists (some view, or an mmap object, holds it).
        Takes no reference to either (safe from any thread)."""
        if self._mm_ref is not None:
            return _mapping_open(self._mm_proxy)
        return _holder_alive(self._holder_proxy)

    def views_alive(self) -> bool:
        """Whether the holder (any tensor over the region) lives. Takes no reference."""
        return _holder_alive(self._holder_proxy)

    def mmap(self) -> RegionMapping | None:
        """The mmap object, while it exists: a strong reference for its owner (sglang's
        `mm`), which keeps the range mapped while held. Measuring code never calls it."""
        return self._mm_ref() if self._mm_ref is not None else None

    def open_fd_count(self) -> int:
        """fds the process holds for this region: its own, plus mmap's internal dup.
        Takes no reference to the mapping."""
        own = 1 if self._fd_box else 0
        dup = 1 if (self.facts.dev_ino is not None and _mapping_open(self._mm_proxy)) else 0
        return own + dup

    def borrow_fd(self) -> int | None:
        """A dup of the Region's fd, verified to be the same inode, or None once released.

        fd numbers are reused by the kernel: nothing acts on a bare number after the
        Region may have closed it. The caller closes the dup. Out of fds (EMFILE, ENFILE)
        raises OSError: the region is still there, and the caller may free an fd and retry.
        """
        fd = self.fd
        if fd is None or self.facts.dev_ino is None:
            return None
        return dup_if_same(fd, self.facts.dev_ino)

    def resident_bytes(self) -> int:
        """Bytes of this region backed by memory now; 0 once it is gone.

        fd-backed: `fstat().st_blocks` (hugetlb included); anonymous and torch:
        `mincore`, counted only if the mapping (or the holder)
        is still there after it. Holds no reference: a release or the owner's last view
        is never delayed by a measurement, and one that ends the region meanwhile makes
        it count 0 (mincore never touches the pages; on an unmapped range it is ENOMEM).
        """
        if self.facts.dev_ino is not None:
            return self.scrape()[1]
        if not self.mapped:
            return 0
        start = self.facts.address & ~(syscalls.PAGE_SIZE - 1)
        length = self.facts.address + self.facts.mapped_bytes - start
        try:
            pages = syscalls.mincore_resident_pages(start, length)
        except OSError:
            return 0  # ENOMEM: unmapped since the check above
        if not self.mapped:
            return 0  # gone during mincore: what it saw may be another mapping's pages
        return min(self.facts.mapped_bytes, pages * syscalls.PAGE_SIZE)

    def scrape(self) -> tuple[int, int]:
        """(open fds, resident bytes) in one pass: what a scrape needs, as cheaply as it can.

        One fstat per fd-backed region (verified against `dev_ino`: the number may name
        another file once released); mincore for anonymous ones. Holds no reference to the
        mapping or the holder (see `resident_bytes`), so it may run on any thread while the
        region is released.
        """
        if self.facts.dev_ino is None:
            return 0, self.resident_bytes()
        dup = 1 if _mapping_open(self._mm_proxy) else 0
        box = self._fd_box
        if not box:
            return dup, 0
        try:
            st = os.fstat(box[0])
        except (OSError, IndexError):
            return dup, 0
        if (st.st_dev, st.st_ino) != self.facts.dev_ino:
            return dup, 0
        blocks = st.st_blocks * 512
        return 1 + dup, blocks if blocks < self.facts.mapped_bytes else self.facts.mapped_bytes

    def close(self) -> bool:
        """Release the Region's own fd and unmap if no view lives. Idempotent.

        Returns True when the mapping is gone now; False when live views still hold it
        ("released, still mapped"): it goes with the last view, never under it.
        A number that names another file by now is left open and kept in `fd_reused`.
        """
        fd = _claim(self._fd_box)
        if fd is not None and not close_if_same(fd, self.facts.dev_ino):
            self.fd_reused = fd
        mm = self.mmap()
        if mm is not None:
            try:
                mmap.mmap.close(mm)
            except BufferError:
                return False
            return True
        return not self.views_alive()


if TYPE_CHECKING:

    def _conforms(region: Region) -> RegionLike:
        return region  # mypy: Region implements RegionLike
