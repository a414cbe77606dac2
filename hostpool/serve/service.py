"""The pools `hostpool serve` holds: allocated at start, released exactly once at stop.

A pool is memory, not tensors: each chunk is a buffer (`allocate_buffer`), so serve, and
everything it shares, runs without torch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hostpool.base import events
from hostpool.core.allocators import HostTensorAllocator
from hostpool.core.manager import LeakReport, PoolManager
from hostpool.core.records import AllocationRecord
from hostpool.serve import debugdoc
from hostpool.serve.config import PoolSpec, ServeConfig

# progress(pool, done_bytes, total_bytes)
Progress = Callable[[str, int, int], None]


@dataclass
class ServedPool:
    """One configured pool as serve holds it: its spec (size, allocator, parsed options),
    its allocator, and its regions' buffers (one per chunk: the ctypes byte arrays of
    `allocate_buffer`, each owning its mapping), in allocation order."""

    spec: PoolSpec
    allocator: HostTensorAllocator
    regions: list[Any] = field(default_factory=list)

    def release(self) -> None:
        """Release every region explicitly (newest first); the last view goes with it."""
        while self.regions:
            buffer = self.regions.pop()
            self.allocator.release(buffer)
            del buffer  # the last view: the mapping goes now


class PoolService:
    """Owns a PoolManager and every configured pool (`pools`: name -> ServedPool)."""

    def __init__(self, config: ServeConfig, *, track_stacks: bool = False) -> None:
        self.config = config
        self.host_budget: Any = None
        budget: Any = config.budget
        if config.host_budget is not None:
            from hostpool.core.hostbudget import HostBudget

            budget = self.host_budget = HostBudget(config.host_budget, config.budget_dir)
        self.manager = PoolManager(budget=budget, track_stacks=track_stacks)
        self.pools: dict[str, ServedPool] = {}
        self.started_at = time.time()

    def allocate_all(
        self, progress: Progress | None = None, *, stop: threading.Event | None = None
    ) -> None:
        """Allocate every pool in chunks (so progress can be shown while populating);
        once `stop` is set, no further chunk is started (close() releases what was made)."""
        for spec in self.config.pools:
            self._allocate_pool(spec, progress, stop)

    def _allocate_pool(
        self, spec: PoolSpec, progress: Progress | None, stop: threading.Event | None
    ) -> None:
        allocator = self.manager.allocator(spec.name, spec.allocator, region_options=spec.options)
        served = self.pools.setdefault(spec.name, ServedPool(spec, allocator))
        chunks = served.regions
        done = 0
        started = time.perf_counter()
        if progress is not None:
            progress(spec.name, 0, spec.size)
        while done < spec.size:
            if stop is not None and stop.is_set():
                return
            n = min(spec.chunk, spec.size - done)
            chunks.append(allocator.allocate_buffer(n))
            done += n
            if progress is not None:
                progress(spec.name, done, spec.size)
        events.info(
            "hostpool.pool_ready",
            pool=spec.name,
            bytes=spec.size,
            chunks=len(chunks),
            allocator=spec.allocator,
            seconds=round(time.perf_counter() - started, 3),
        )

    def snapshot(self) -> list[AllocationRecord]:
        return self.manager.snapshot()

    def debug_document(self) -> dict[str, Any]:
        """What /debug/pools serves (see hostpool.serve.debugdoc.debug_document)."""
        return debugdoc.debug_document(self.manager, self.started_at)

    def close(self) -> LeakReport:
        """Release every pool explicitly, then drop the buffers so nothing stays mapped."""
        for served in self.pools.values():
            served.release()
        report = self.manager.close()
        if self.host_budget is not None:
            self.host_budget.close()  # its reservation file goes with it
        return report
