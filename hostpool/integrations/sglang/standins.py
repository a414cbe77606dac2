"""What hostpool hands sglang in place of its own: allocator classes whose memory is
hostpool's, foreign allocators' tensors recorded in the ledger, a pool's explicit
release, and the multiprocess publisher started at the first tracked allocation."""

from __future__ import annotations

import math
import os
from typing import Any

from hostpool.errors import ShareError
from hostpool.integrations.sglang import internals
from hostpool.integrations.sglang.labels import current_pool, pool_name
from hostpool.integrations.sglang.rules import mmap_options

FOREIGN_KINDS = ("mooncake", "tensorcast", "mori")
# `hostpool serve --share-socket PATH`: the stand-ins take every pool's memory from there
BROKER_VARIABLE = "HOSTPOOL_BROKER"
ALIGN = 4096


class BrokerPool:
    """A pool of the broker leased by a stand-in allocator: its allocations are carved from
    the leased memory in order (page-aligned), so an engine restarted with the same pools
    gets each buffer at the same offset. Memory only: no index; the lease ends at
    `close()`, each buffer's mapping with its last view."""

    def __init__(self, path: str, pool: str) -> None:
        from hostpool.broker.client import lease

        self.pool = pool
        self.lease = lease(path, pool)
        self.size = self.lease.size
        self.mapping = self.lease.hand_over()
        self.used = 0

    def allocate(self, dims: tuple[int, ...], dtype: Any) -> Any:
        import torch

        count = math.prod(dims)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        start = -(-self.used // ALIGN) * ALIGN
        if nbytes <= 0 or start + nbytes > self.size:
            raise ShareError(
                f"broker pool {self.pool!r} holds {self.size} bytes, {start} already given "
                f"to this allocator's buffers; {nbytes} more asked ({list(dims)} {dtype}): "
                "give the pool more (`hostpool serve --pool NAME=SIZE`)"
            )
        self.used = start + nbytes
        view = self.mapping.array(start, nbytes)
        return torch.frombuffer(view, dtype=dtype, count=count).view(dims)

    def close(self) -> None:
        self.lease.close()


def allocator_classes(base: type) -> tuple[type, type]:
    """Subclasses of sglang's base allocator class (its isinstance checks keep working)."""
    from hostpool.core import allocators

    class HostTensorAllocator(base):  # type: ignore[misc]
        """sglang's default host allocator on hostpool: anonymous memory, tracked."""

        hostpool_kind = "mmap"

        def __init__(self) -> None:
            super().__init__()
            self.hostpool_allocator: allocators.HostTensorAllocator | None = None
            self.broker_pool: BrokerPool | None = None

        def allocate(self, dims: tuple[int, ...], dtype: Any, device: str) -> Any:
            assert device == "cpu", (
                f"{type(self).__name__} only supports CPU allocations; got device={device!r}"
            )
            self.dtype = dtype
            self.dims = dims
            broker = os.environ.get(BROKER_VARIABLE)
            if broker:  # memory only: the broker's pool of the same name, carved in order
                if self.broker_pool is None:
                    self.broker_pool = BrokerPool(broker, current_pool(self))
                return self.broker_pool.allocate(dims, dtype)
            tensor = self._hostpool(current_pool(self)).allocate(dims, dtype)
            self._made(tensor)
            publish_metrics()
            return tensor

        def _hostpool(self, pool: str) -> allocators.HostTensorAllocator:
            if self.hostpool_allocator is None:
                # Retaining: the pool's destroy() releases; a pool dropped without it
                # is the leak signal (`finalizer`), not a tensor's normal end.
                self.hostpool_allocator = allocators.create_allocator(
                    self.hostpool_kind, pool=pool, retain=True, **mmap_options()
                )
            return self.hostpool_allocator

        def _made(self, tensor: Any) -> None:
            """Hook for the shm allocator's fds/mms."""

        def close(self) -> None:
            """Release every region explicitly (sglang's `destroy()` calls this); a
            broker's pool: end the lease (the broker keeps the memory)."""
            if self.hostpool_allocator is not None:
                self.hostpool_allocator.close()
            if self.broker_pool is not None:
                self.broker_pool.close()

    class ShmHostTensorAllocator(HostTensorAllocator):
        """sglang's shm allocator on hostpool memfds: `fds`/`mms` hold every allocation
        for the allocator's life, `fd`/`mm` are the first. Collected without `destroy()`:
        its regions go through the ledger's finalizer (the leak signal); no fd is closed
        behind the ledger's back. It does not inherit sglang's shm class, whose `__del__`
        closes the fds (the ledger's own); sglang's dispatch hands out this one instead
        (and install() names it where sglang's state capturer constructs allocators)."""

        hostpool_kind = "shm"

        def __init__(self) -> None:
            HostTensorAllocator.__init__(self)
            self.fds: list[int] = []
            self.mms: list[Any] = []

        def _hostpool(self, pool: str) -> allocators.HostTensorAllocator:
            if self.hostpool_allocator is None:
                self.hostpool_allocator = allocators.ShmHostTensorAllocator(pool, retain=True)
            return self.hostpool_allocator

        def _made(self, tensor: Any) -> None:
            hp = self.hostpool_allocator
            assert isinstance(hp, allocators.ShmHostTensorAllocator)
            self.fds = hp.fds
            self.mms = hp.mms

        @property
        def fd(self) -> int | None:
            return self.fds[0] if self.fds else None

        @property
        def mm(self) -> Any:
            return self.mms[0] if self.mms else None

        def close(self) -> None:
            self.fds = []
            self.mms = []
            super().close()

    HostTensorAllocator.__qualname__ = HostTensorAllocator.__name__
    ShmHostTensorAllocator.__qualname__ = ShmHostTensorAllocator.__name__
    HostTensorAllocator.__module__ = __name__
    ShmHostTensorAllocator.__module__ = __name__
    return HostTensorAllocator, ShmHostTensorAllocator


def track_foreign(allocator: Any, kind: str) -> None:
    """Wrap `allocator.allocate` on the instance (its type stays sglang's): each tensor it
    makes is recorded as a foreign region of the pool being built."""
    original = allocator.allocate
    if getattr(original, "hostpool_foreign", False):
        return
    kind = pool_name(kind if kind in FOREIGN_KINDS else type(allocator).__name__)
    owner = ForeignOwner(kind)

    def allocate(dims: Any, dtype: Any, device: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
        tensor = original(dims, dtype, device, *args, **kwargs)
        if getattr(tensor, "device", None) is None or tensor.device.type != "cpu":
            return tensor
        return owner.record(tensor, current_pool(allocator))

    allocate.hostpool_foreign = True  # type: ignore[attr-defined]
    allocator.allocate = allocate
    allocator.hostpool_foreign_owner = owner


class ForeignOwner:
    """The ledger owner of one foreign allocator's regions (released by destroy())."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.id = -next(_foreign_ids)  # allocators count up from 1: no clash

    def record(self, tensor: Any, pool: str) -> Any:
        from hostpool.core.ledger import get_ledger
        from hostpool.memory.holders import adopt

        ledger = get_ledger()
        region, view = adopt(tensor, pool, ledger.unmapped_callback())
        ledger.add_pool(pool)
        ledger.record(
            region,
            allocator=self.kind,
            owner=self.id,
            stack=None,
            seconds=0.0,
            dims=tuple(view.shape),
            dtype=str(view.dtype),
        )
        publish_metrics()
        return view

    def close(self) -> None:
        from hostpool.core.ledger import get_ledger

        ledger = get_ledger()
        for region in ledger.regions(owner=self.id):
            ledger.release(region.facts.id)


_foreign_ids = iter(range(1, 1 << 62))


def release_pool(pool: Any) -> None:
    """Release a host pool's regions explicitly: its normal teardown, not a leak."""
    allocator = getattr(pool, "__dict__", {}).get(internals.POOL_ALLOCATOR)
    if allocator is None:
        return
    close = getattr(allocator, "close", None)
    owner = getattr(allocator, "hostpool_foreign_owner", None)
    if owner is not None:
        owner.close()
    elif close is not None and getattr(allocator, "hostpool_kind", None) is not None:
        close()


def publish_metrics() -> None:
    """After each tracked allocation: this process's multiprocess publisher, when sglang
    runs prometheus_client in multiprocess mode (started once per process, forked children
    included). Never raises: publishing must not fail an allocation that succeeded."""
    from hostpool.metrics.multiprocess import ensure_publisher

    ensure_publisher()
