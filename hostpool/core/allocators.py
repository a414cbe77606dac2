"""Host tensor allocators: the interface sglang's host KV pools use, recorded in the ledger.

An allocator keeps facts and weak references only (its `fds`/`mms` are computed from its
live regions): dropping the tensors (or buffers) frees the memory, in a manager or not."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import time
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from hostpool._lazy import require_torch
from hostpool.base import events
from hostpool.base.locks import ForkSafeLock
from hostpool.core.budget import Admission, Reservation, process_admission
from hostpool.core.ledger import Ledger, get_ledger
from hostpool.core.ledger_events import emit_alloc
from hostpool.core.records import capture_stack
from hostpool.core.requests import buffer_bytes, check_device, request_bytes
from hostpool.errors import AllocationError, ConfigError, HostPoolError, InvalidRequestError
from hostpool.memory.create import backend_of, create_region, plan_fallback
from hostpool.memory.holders import tensor_over
from hostpool.memory.hugepages import HugepagePlan, plan_hugepages
from hostpool.memory.interface import RegionLike
from hostpool.memory.options import RegionOptions, validate_pool_name
from hostpool.memory.region import Region
from hostpool.words import AllocatorKind

if TYPE_CHECKING:  # torch is imported where a tensor is made (hostpool never installs it)
    import torch

_allocator_ids = itertools.count(1)
_M = TypeVar("_M")  # what an allocator hands out: a tensor or a buffer


class HostTensorAllocator:
    """Makes host tensors (or torch-free buffers: `allocate_buffer`) of one pool; every
    region is recorded in the process ledger. Only the tensor methods import torch
    (TorchUnavailableError without it).

    By default the tensors own their memory: dropping one frees its region, a `tensor`
    release. With `retain=True` (what a server's pool allocator is: sglang's) the allocator
    keeps each allocation until `release()`/`close()`; collected without them, its regions
    end as `finalizer` releases, the leak signal.
    """

    kind: ClassVar[AllocatorKind]
    registered_name: ClassVar[str]

    def __init__(
        self,
        pool: str = "default",
        *,
        ledger: Ledger | None = None,
        track_stacks: bool | None = None,
        admission: Admission | None = None,
        retain: bool = False,
        region_options: RegionOptions | None = None,
        **options: Any,
    ) -> None:
        self.pool = validate_pool_name(pool)
        self._retained: list[Any] | None = [] if retain else None  # tensors or buffers
        if region_options is not None and options:
            raise InvalidRequestError(
                f"pass options as region_options or as keywords, not both: {sorted(options)}"
            )
        self.options = region_options or RegionOptions.parse(**options)
        self._ledger = ledger or get_ledger()
        self._id = next(_allocator_ids)
        self._track_stacks = track_stacks
        self._admission = admission
        self._closed = False
        # close() sets _closed under it and a region is recorded under it: no allocation
        # in flight commits after close() has listed what to release.
        self._commit_lock = ForkSafeLock()
        self._ledger.add_pool(self.pool)
        if self.options.pin:
            _warn_pin_unavailable_once()

    # -- the interface ---------------------------------------------------------------
    def allocate(self, dims: Any, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
        """A tensor of `dims`/`dtype` over fresh, populated host memory."""
        tensor, _region = self.allocate_region(dims, dtype, device)
        return self._retain(tensor)

    def allocate_buffer(self, nbytes: int) -> ctypes.Array[ctypes.c_ubyte]:
        """`nbytes` of fresh, populated host memory as a writable ctypes byte array, without
        torch: the region's holder, which owns the memory as a tensor over it would
        (dropped, it frees the region; `memoryview(buffer)` reads and writes it). Released
        by `release(buffer)`; raises what `allocate()` raises (TorchUnavailableError only
        for the `torch` kind, whose memory is torch's)."""
        if self.kind == "torch":
            require_torch(f"{type(self).__name__}.allocate_buffer")
        started = time.perf_counter()
        try:
            nbytes = buffer_bytes(nbytes)
        except HostPoolError as exc:
            self.count_failure(exc, started)
            raise
        holder, _region = self._allocate_holder(nbytes, (nbytes,), "torch.uint8", started)
        return self._retain(holder)

    def _retain(self, memory: _M) -> _M:
        if self._retained is not None:
            with self._commit_lock:
                if not self._closed and self._retained is not None:
                    self._retained.append(memory)
        return memory

    def release(self, tensor: Any) -> bool:
        """Release the one region `tensor` (a tensor, or a buffer of `allocate_buffer`)
        lives in (a pool shrinking, a churned buffer).

        Returns True when it is unmapped now, False when other views still hold it.
        Raises InvalidRequestError for memory this allocator did not make.
        """
        address = _address_of(tensor)
        for region in self._ledger.regions(owner=self._id):
            start = region.facts.address
            end = start + max(region.facts.mapped_bytes, 1)
            if start <= address < end:
                gone = bool(self._ledger.release(region.facts.id))
                if self._retained is not None:
                    # Released first, then our reference to the region (a view may start
                    # anywhere inside it) dropped, so nothing of ours keeps it mapped.
                    self._retained = [
                        t for t in self._retained if not start <= _address_of(t) < end
                    ]
                return gone
        raise InvalidRequestError(
            f"tensor at {address:#x} is not a live allocation of pool {self.pool!r}"
        )

    def close(self) -> None:
        """Release every region this allocator made. Live views keep their pages mapped
        ("released, still mapped") until they die; nothing is unmapped under them."""
        with self._commit_lock:
            self._closed = True
            # Release explicitly while our references still hold the regions, then drop
            # them: dropping first would let the GC count the release as a leak.
            retained, self._retained = self._retained, None if self._retained is None else []
        for region in self._ledger.regions(owner=self._id):
            self._ledger.release(region.facts.id)
        del retained

    def __enter__(self) -> HostTensorAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- facts -----------------------------------------------------------------------
    @property
    def owner_id(self) -> int:
        """The ledger's owner id of this allocator's regions (unique in the process)."""
        return self._id

    @property
    def regions(self) -> list[RegionLike]:
        return self._ledger.regions(owner=self._id)

    @property
    def allocated_bytes(self) -> int:
        return sum(r.facts.mapped_bytes for r in self.regions)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(pool={self.pool!r}, regions={len(self.regions)}, "
            f"bytes={self.allocated_bytes})"
        )

    def allocate_region(
        self, dims: Any, dtype: torch.dtype, device: Any = "cpu"
    ) -> tuple[torch.Tensor, Region]:
        """`allocate()` that also returns the Region the tensor lives in (its fd and
        mapping), and never retains the tensor. Raises what `allocate()` raises:
        InvalidRequestError for a bad request, AllocationError when memory is refused,
        TorchUnavailableError without torch (not counted: no request was made)."""
        require_torch(f"{type(self).__name__}.allocate (a tensor)")
        started = time.perf_counter()
        try:
            shape, nbytes = request_bytes(dims, dtype)
            check_device(device)
        except HostPoolError as exc:
            self.count_failure(exc, started)
            raise
        holder, region = self._allocate_holder(nbytes, shape, dtype, started)
        tensor = tensor_over(holder, shape, dtype)
        del holder
        return tensor, region

    # -- internals -------------------------------------------------------------------
    def _allocate_holder(
        self, nbytes: int, shape: tuple[int, ...], dtype: Any, started: float
    ) -> tuple[Any, Region]:
        """(holder, Region) of a validated request: admitted, made, recorded; a failure
        is counted and raised."""
        try:
            if self._closed:
                raise InvalidRequestError(f"allocator for pool {self.pool!r} is closed")
            plan = plan_hugepages(
                self.kind, backend_of(self.kind, self.options), nbytes, self.options
            )
            try:
                region, holder, seconds = self._create_admitted(nbytes, plan, started, shape, dtype)
            except AllocationError as exc:
                # hugetlb refused by its admission or short at mmap: with `prefer`, plan
                # the fallback once and admit it like any other request.
                if not (
                    exc.reason == "hugepages"
                    and plan.hugetlb_size is not None
                    and self.options.hugepages == "prefer"
                ):
                    raise
                plan = plan_fallback(self.kind, nbytes, self.options)
                region, holder, seconds = self._create_admitted(nbytes, plan, started, shape, dtype)
        except HostPoolError as exc:
            if isinstance(exc, AllocationError) and exc.pool is None:
                exc.pool = self.pool  # the layers below do not know the pool
            self.count_failure(exc, started)
            raise
        emit_alloc(region, seconds, self.registered_name, self.options.hugepages)
        return holder, region

    def _create_admitted(
        self,
        nbytes: int,
        plan: HugepagePlan,
        started: float,
        shape: tuple[int, ...],
        dtype: Any,
    ) -> tuple[Region, Any, float]:
        """Reserve, map, and record inside the reservation: the region turns from in
        flight into held atomically, so no admission counts it twice or not at all."""
        admission = self._admission or process_admission(self._ledger)
        with admission.reserve(nbytes, plan.hugetlb_size) as reservation:
            region, holder = create_region(
                nbytes,
                kind=self.kind,
                pool=self.pool,
                options=self.options,
                on_unmapped=self._ledger.unmapped_callback(),
                plan=plan,
            )
            seconds = time.perf_counter() - started
            stack = capture_stack(skip=4) if self._tracking() else None
            with self._commit_lock:
                if self._closed:
                    # close() ran while this one was in flight: undo it, never record it.
                    region.close()
                    del holder  # the mapping goes with it (the Region holds it weakly)
                    raise InvalidRequestError(
                        f"allocator for pool {self.pool!r} was closed while allocating"
                    )
                self._commit(reservation, region, stack, seconds, shape, dtype)
        return region, holder, seconds

    def _commit(
        self,
        reservation: Reservation,
        region: Region,
        stack: str | None,
        seconds: float,
        shape: tuple[int, ...],
        dtype: Any,
    ) -> None:
        reservation.commit(
            lambda: self._ledger.record(
                region,
                allocator=self.registered_name,
                owner=self._id,
                stack=stack,
                seconds=seconds,
                dims=shape,
                dtype=str(dtype),
                owned_by_tensor=self._retained is None,
            )
        )

    def _tracking(self) -> bool:
        if self._track_stacks is not None:
            return self._track_stacks
        return self._ledger.track_stacks

    def count_failure(self, exc: HostPoolError, started: float) -> None:
        """Count a failed allocation of this pool (by `exc.reason`, `invalid` for a bad
        request) and emit `hostpool.alloc_failed`; `started` is its perf_counter() start."""
        reason = exc.reason if isinstance(exc, AllocationError) else "invalid"
        self._ledger.record_failure(self.pool, reason)
        events.warning(
            "hostpool.alloc_failed",
            pool=self.pool,
            allocator=self.registered_name,
            reason=reason,
            error=str(exc),
            seconds=round(time.perf_counter() - started, 6),
        )


class ShmHostTensorAllocator(HostTensorAllocator):
    """memfd-backed (or /dev/shm fallback) tensors another process can map by fd.

    sglang's semantics: `fd`/`mm` are the first of `fds`/`mms` (oldest first). With
    `retain=True` (what the sglang integration uses) the allocator keeps each allocation
    until `close()`/`release()`, so `fds` stay valid for its life, as in sglang; by default
    the tensors own their memory and `fds` lists the live regions only.
    """

    kind = "shm"
    registered_name = "shm"

    @property
    def fds(self) -> list[int]:
        return [r.fd for r in self.regions if r.fd is not None]

    @property
    def mms(self) -> list[mmap.mmap]:
        return [mm for r in self.regions if (mm := r.mmap()) is not None]

    @property
    def fd(self) -> int | None:
        """sglang's `fd`: the first (oldest live) region's fd."""
        fds = self.fds
        return fds[0] if fds else None

    @property
    def mm(self) -> mmap.mmap | None:
        """sglang's `mm`: the first (oldest live) region's mapping."""
        mms = self.mms
        return mms[0] if mms else None


class MmapHostTensorAllocator(HostTensorAllocator):
    """Private anonymous mmap: not shareable, but THP-eligible and cheap to fault."""

    kind = "mmap"
    registered_name = "mmap"


class DefaultHostTensorAllocator(HostTensorAllocator):
    """Plain torch.empty memory, tracked like the others."""

    kind = "torch"
    registered_name = "default"


_registry: dict[str, type[HostTensorAllocator]] = {
    "shm": ShmHostTensorAllocator,
    "mmap": MmapHostTensorAllocator,
    "default": DefaultHostTensorAllocator,
}


def register_allocator(name: str, cls: type[HostTensorAllocator]) -> None:
    """Make `cls` available to `create_allocator(name)` and server configs."""
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"allocator name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, HostTensorAllocator)):
        raise InvalidRequestError(f"{cls!r} is not a HostTensorAllocator subclass")
    _registry[name] = cls


def allocator_names() -> list[str]:
    return sorted(_registry)


def allocator_class(name: str) -> type[HostTensorAllocator]:
    try:
        return _registry[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown allocator {name!r}; registered allocators: {allocator_names()}"
        ) from None


def create_allocator(name: str, **options: Any) -> HostTensorAllocator:
    """An allocator of a registered type (`shm`, `mmap`, `default`, or registered)."""
    return allocator_class(name)(**options)


def _address_of(memory: Any) -> int:
    """The start address of a tensor or of a ctypes buffer (`allocate_buffer`)."""
    if isinstance(memory, ctypes.Array):
        return ctypes.addressof(memory)
    return int(memory.data_ptr())


_pin_warned = False


def _warn_pin_unavailable_once() -> None:
    global _pin_warned
    from hostpool.memory import cuda

    if _pin_warned or cuda.get_runtime().available():
        return
    _pin_warned = True
    events.info("hostpool.pin_unavailable", reason="torch has no CUDA; pin=True is a no-op")
