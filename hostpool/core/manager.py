"""PoolManager: one allocator per pool, a budget, snapshots, and close.

The public `hostpool.HostPoolManager` is this class plus `register_metrics()`
(`hostpool/manager.py`): metrics are presentation, a floor above the core."""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Self

from hostpool.base import events
from hostpool.base.locks import ForkSafeLock
from hostpool.base.units import format_size
from hostpool.core.allocators import HostTensorAllocator, allocator_class
from hostpool.core.budget import (
    Admission,
    BudgetPolicy,
    BudgetView,
    admissions,
    as_policy,
    budget_view,
    register_admission,
    unregister_admission,
)
from hostpool.core.leases import LeaseBook
from hostpool.core.ledger import Ledger, get_ledger
from hostpool.core.ledger_events import emit_leak
from hostpool.core.records import AllocationRecord
from hostpool.errors import InvalidRequestError
from hostpool.memory.options import validate_pool_name


@dataclass(frozen=True)
class LeakReport:
    """Regions still mapped by live tensors when the manager closed."""

    leaks: tuple[AllocationRecord, ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return bool(self.leaks)

    @property
    def leaked_bytes(self) -> int:
        return sum(r.mapped_bytes for r in self.leaks)

    def __str__(self) -> str:
        if not self.leaks:
            return "no leaks"
        lines = [f"{len(self.leaks)} region(s), {format_size(self.leaked_bytes)} still mapped:"]
        for r in self.leaks:
            lines.append(
                f"- pool {r.pool}: {r.mapped_bytes} bytes ({format_size(r.mapped_bytes)}), "
                f"{r.allocator} allocator, {r.name or r.backend}"
            )
            if r.stack:
                lines.extend("    " + line for line in r.stack.rstrip().splitlines())
        return "\n".join(lines)


class PoolManager:
    """Owns one allocator per pool; a view of the process-wide ledger."""

    def __init__(
        self,
        *,
        track_stacks: bool = False,
        budget: int | BudgetPolicy | None = None,
        headroom: int | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self._ledger = ledger or get_ledger()
        # True: always; None: whatever the ledger says at each allocation (the leak
        # check's plugin turns it on for the test it checks).
        self._track_stacks: bool | None = True if track_stacks else None
        self._lock = ForkSafeLock()
        self._allocators: dict[str, HostTensorAllocator] = {}
        # Ids of this manager's allocators. Nothing the ledger or the admission holds
        # refers back to the manager, so dropping it without close() collects it; the
        # finalizer then has the ledger release its regions and report them as a leak.
        self._owners: list[int] = []  # appended only: a reader may iterate it meanwhile
        held = functools.partial(self._ledger.held_bytes, self._owners)
        self._admission = Admission(as_policy(budget), held, headroom=headroom)
        register_admission(self._ledger, self._admission)
        self._finalizer = weakref.finalize(
            self, self._ledger.owners_dropped_callback(), self._owners
        )
        self._finalizer.atexit = False
        self._closed = False
        # Who leases which part of its pools, and what was adopted there (a broker lending
        # this manager's pools keeps its leases here; /debug/pools shows them per pool).
        self.leases = LeaseBook()

    def allocator(
        self, pool: str, allocator_type: str = "shm", **options: Any
    ) -> HostTensorAllocator:
        """The pool's allocator, created on first use with these options."""
        validate_pool_name(pool)
        with self._lock:
            if self._closed:
                raise InvalidRequestError("this HostPoolManager is closed")
            existing = self._allocators.get(pool)
            if existing is not None:
                if existing.registered_name != allocator_type:
                    raise InvalidRequestError(
                        f"pool {pool!r} already uses the {existing.registered_name!r} "
                        f"allocator, not {allocator_type!r}"
                    )
                return existing
            cls = allocator_class(allocator_type)
            created = cls(
                pool,
                ledger=self._ledger,
                track_stacks=self._track_stacks,
                admission=self._admission,
                **options,
            )
            self._allocators[pool] = created
            self._owners.append(created.owner_id)
            return created

    def allocator_for(self, pool: str) -> HostTensorAllocator | None:
        """The pool's allocator if it exists (never creates one)."""
        return self._allocators.get(pool)

    @property
    def pools(self) -> list[str]:
        return list(self._allocators)

    def _owner_ids(self) -> set[int]:
        return set(self._owners)

    def _held_bytes(self) -> int:
        return self._ledger.held_bytes(self._owners)

    def snapshot(self) -> list[AllocationRecord]:
        """Plain records of this manager's regions (live and released-still-mapped)."""
        return self._ledger.snapshot(owners=self._owner_ids())

    def totals(self) -> dict[str, dict[str, int]]:
        """Per pool: live allocations, allocated bytes, released-still-mapped bytes."""
        out: dict[str, dict[str, int]] = {
            p: {"allocations": 0, "bytes": 0, "released_mapped_bytes": 0} for p in self.pools
        }
        for r in self.snapshot():
            t = out.setdefault(r.pool, {"allocations": 0, "bytes": 0, "released_mapped_bytes": 0})
            if r.state == "live":
                t["allocations"] += 1
                t["bytes"] += r.mapped_bytes
            elif r.state == "released_mapped":
                t["released_mapped_bytes"] += r.mapped_bytes
        return out

    @property
    def budget_bytes(self) -> int | None:
        return self._admission.limit_bytes()

    @property
    def budget_reserved_bytes(self) -> int:
        return self._admission.reserved_bytes()

    def budget_view(self) -> BudgetView:
        """Every limit that applies to this process now, and what it reserves: the same
        numbers as `hostpool_budget_bytes{limit}` and `hostpool_budget_reserved_bytes`."""
        return budget_view(admissions(self._ledger), self._ledger.held_bytes())

    @property
    def ledger(self) -> Ledger:
        """The ledger this manager records in (the process's one ledger)."""
        return self._ledger

    def close(self) -> LeakReport:
        """Release every region; those still mapped by live tensors are the LeakReport."""
        with self._lock:
            already = self._closed
            self._closed = True
            allocators = list(self._allocators.values())
        self._finalizer.detach()  # closed: nothing to report when it is collected
        for a in allocators:
            a.close()
        settle = getattr(self._admission.policy, "settle", None)
        if settle is not None:
            settle(self._held_bytes())  # give the host-wide share back
        owners = {a.owner_id for a in allocators}
        leaks = tuple(
            r for r in self._ledger.snapshot(owners=owners) if r.state == "released_mapped"
        )
        for r in () if already else leaks:
            emit_leak(r.pool, r.mapped_bytes, r.name, r.allocator, r.stack)
        if not already:
            self._emit_closed(allocators, leaks)
        unregister_admission(self._ledger, self._admission)
        return LeakReport(leaks)

    def _emit_closed(
        self, allocators: list[HostTensorAllocator], leaks: tuple[AllocationRecord, ...]
    ) -> None:
        """`hostpool.pool_closed` (info) per pool: the per-allocation events are debug, so
        this is where an operator reads what the pool's allocator did in this manager:
        regions and bytes allocated, released by how, and still mapped (the leaks)."""
        for a in allocators:
            summary = self._ledger.take_owner_summary(a.owner_id)
            if not events.stdlib_logger.isEnabledFor(logging.INFO):
                continue
            allocated = summary.pop("allocated", (0, 0))
            mapped = [r for r in leaks if r.pool == a.pool]
            events.info(
                "hostpool.pool_closed",
                pool=a.pool,
                allocator=a.registered_name,
                allocations=allocated[0],
                allocated_bytes=allocated[1],
                released_regions=sum(n for n, _ in summary.values()),
                released_bytes=sum(b for _, b in summary.values()),
                releases={how: n for how, (n, _) in summary.items()},
                leaks=len(mapped),  # still mapped by live views: the LeakReport
                leaked_bytes=sum(r.mapped_bytes for r in mapped),
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
