"""`--demo-load`: a background workload so every dashboard row has data.

It writes and reads pages of the configured pools, churns allocations in a `demo` pool
(released explicitly, some dropped with their buffers, and a few leaked on purpose by an
owner dropped without close(): the `finalizer` release, the leak signal), and every
`provoke_every` seconds provokes a hugepage fallback and a refused allocation, so the
alerts they feed (HostpoolHugepageFallbacks, HostpoolAllocationFailures,
HostpoolFinalizerReleases) fire on any scrape interval: increase() needs a sample before
the rise, and a one-off rise before the first scrape is never seen.
"""

from __future__ import annotations

import random
import threading
from typing import Any

from hostpool.base import events
from hostpool.core.allocators import ShmHostTensorAllocator
from hostpool.errors import HostPoolError
from hostpool.memory import kernel
from hostpool.serve.service import PoolService

PAGE = 4096


class DemoLoad:
    def __init__(
        self,
        service: PoolService,
        *,
        interval: float = 0.2,
        seed: int = 0,
        provoke_after: float = 5.0,
        provoke_every: float = 10.0,
    ) -> None:
        self.provoke_after = provoke_after
        self.provoke_every = provoke_every
        self.provoked = 0
        self.service = service
        self.interval = interval
        self.rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostpool-demo", daemon=True)
        self.cycles = 0
        self._held: dict[str, list[Any]] = {"demo": [], "demo_hugepages": []}  # buffers

    def start(self) -> DemoLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the workload and release what it holds, explicitly."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for pool in ("demo", "demo_hugepages"):
            allocator = self.service.manager.allocator_for(pool)
            held = self._held.pop(pool, [])
            while held and allocator is not None:
                allocator.release(held.pop())

    def _fallback_target(self) -> tuple[int, int]:
        """(hugepage size, bytes) that cannot fit its hugetlb pool: the cheapest to ask."""
        pools = kernel.hugepage_pools()
        if not pools:
            return 2 << 20, 2 << 20
        size = min(pools, key=lambda s: ((pools[s].available + 1) * s, s))
        return size, (pools[size].available + 1) * size

    def _provoke_once(self) -> None:
        manager = self.service.manager
        size, want = self._fallback_target()
        fallback = manager.allocator(
            "demo_hugepages", "shm", hugepages="prefer", hugepage_size=size
        )
        held = self._held["demo_hugepages"]
        while held:  # the previous round's, released before the next: nothing accumulates
            fallback.release(held.pop())
        if want <= 64 << 20:  # a counted fallback, never an error; skipped if it would be big
            try:
                self._held["demo_hugepages"].append(fallback.allocate_buffer(want))
            except HostPoolError as exc:  # e.g. a tight budget: still shows on the dashboard
                events.info("hostpool.demo", step="fallback", error=str(exc))
        # One refused allocation: more than the host has.
        refused = manager.allocator("demo_refused", "mmap", populate="none")
        total = kernel.meminfo().get("MemTotal", 1 << 40)
        try:
            refused.allocate_buffer(2 * total)
        except HostPoolError as exc:
            events.info("hostpool.demo", step="refused", reason=getattr(exc, "reason", None))

    def _run(self) -> None:
        churn = self.service.manager.allocator("demo", "shm")
        kept = self._held["demo"]
        # Name the pools first and provoke later, so a scraper sees their counters at 0
        # before they move (increase() cannot see a series born above 0).
        self.service.manager.allocator("demo_refused", "mmap", populate="none")
        size, _ = self._fallback_target()
        self.service.manager.allocator(
            "demo_hugepages", "shm", hugepages="prefer", hugepage_size=size
        )
        next_provoke = self.provoke_after
        while not self._stop.wait(self.interval):
            self.cycles += 1
            if self.cycles * self.interval >= next_provoke:
                self._provoke_once()
                self.provoked += 1
                next_provoke += self.provoke_every
            for chunks in [p.regions for p in list(self.service.pools.values())]:
                if not chunks:
                    continue
                with memoryview(self.rng.choice(chunks)).cast("B") as page:
                    offset = self.rng.randrange(0, max(1, len(page) - PAGE)) // PAGE * PAGE
                    page[offset : offset + PAGE] = bytes([self.cycles % 251]) * PAGE
                    _ = page[offset]
            try:
                n = self.rng.choice((64 << 10, 1 << 20, 4 << 20))
                t = churn.allocate_buffer(n)
            except HostPoolError:
                continue
            if self.cycles % 3 != 0:  # every third is dropped: it ends with its buffer
                kept.append(t)
            del t
            if self.cycles % 9 == 0:
                _leak_one(n)
            if len(kept) > 4:
                churn.release(kept.pop(0))


def _leak_one(nbytes: int) -> None:
    """A region whose owner is collected without close(): the leak signal, on purpose."""
    owner = ShmHostTensorAllocator("demo", retain=True)
    owner.allocate_buffer(nbytes)
    del owner  # collected with the region it retains: a `finalizer` release
