"""Admission control: a request is refused before any mmap when it cannot fit.

Normal pages: min(explicit budget or policy, MemAvailable minus a headroom, cgroup limit
minus usage). Hugetlb-backed requests: free minus reserved pages of that size and the
hugetlb cgroup limit only (reserved hugepages are already gone from MemAvailable).
Reservations are taken under one lock and held across the mmap, so concurrent
allocations cannot jointly overshoot.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hostpool.errors import AllocationError, InvalidRequestError
from hostpool.memory import cgroup, kernel
from hostpool.units import format_size


@runtime_checkable
class BudgetPolicy(Protocol):
    """A budget beyond this process's view (the host-wide budget of the pools layer)."""

    def limit_bytes(self) -> int: ...

    def admit(self, need: int, held: int) -> None:
        """Raise AllocationError(reason="budget") unless `held + need` fits."""

    def reserved_bytes(self) -> int: ...


@dataclass
class FixedBudget:
    """An explicit byte budget for one manager."""

    limit: int

    def limit_bytes(self) -> int:
        return self.limit

    def admit(self, need: int, held: int) -> None:
        if held + need > self.limit:
            raise AllocationError(
                f"budget refused: need {_b(need)} with {_b(held)} already held, budget "
                f"{_b(self.limit)} (explicit budget)",
                reason="budget",
            )

    def reserved_bytes(self) -> int:
        return 0  # the Admission that owns it knows what is held


def _b(n: int) -> str:
    return f"{n} bytes ({format_size(n)})"


def as_policy(budget: int | BudgetPolicy | None) -> BudgetPolicy | None:
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise InvalidRequestError(f"budget must be bytes or a policy, got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise InvalidRequestError(f"budget must be positive, got {budget}")
        return FixedBudget(budget)
    if isinstance(budget, BudgetPolicy):
        return budget
    raise InvalidRequestError(f"budget must be bytes or a BudgetPolicy, got {budget!r}")


def default_headroom() -> int:
    """Memory left for everything else: 5% of RAM, at least 256 MiB, at most 4 GiB."""
    total = kernel.meminfo().get("MemTotal", 0)
    return min(4 << 30, max(256 << 20, total // 20))


class Admission:
    """Reserves bytes under a lock for the duration of an allocation."""

    def __init__(
        self,
        policy: BudgetPolicy | None,
        held_bytes: Callable[[], int],
        *,
        headroom: int | None = None,
    ) -> None:
        self.policy = policy
        self._held_bytes = held_bytes
        self.headroom = default_headroom() if headroom is None else headroom
        self._lock = threading.Lock()
        self._inflight = 0
        self._inflight_huge: dict[int, int] = {}

    @contextlib.contextmanager
    def reserve(self, need: int, hugetlb_page_size: int | None) -> Iterator[None]:
        with self._lock:
            if hugetlb_page_size is None:
                self._check_normal(need)
                self._inflight += need
            else:
                self._check_hugetlb(need, hugetlb_page_size)
                self._inflight_huge[hugetlb_page_size] = (
                    self._inflight_huge.get(hugetlb_page_size, 0) + need
                )
        try:
            yield
        finally:
            with self._lock:
                if hugetlb_page_size is None:
                    self._inflight -= need
                else:
                    self._inflight_huge[hugetlb_page_size] -= need
            settle = getattr(self.policy, "settle", None)
            if settle is not None and hugetlb_page_size is None:
                # A policy spanning processes (the host-wide budget) shrinks its
                # reservation to what is held now: a failed allocation keeps nothing.
                settle(self._held_bytes() + self._inflight)

    def _check_normal(self, need: int) -> None:
        inflight = self._inflight
        if self.policy is not None:
            self.policy.admit(need, self._held_bytes() + inflight)
        available = kernel.meminfo().get("MemAvailable", 0) - self.headroom - inflight
        if need > available:
            raise AllocationError(
                f"budget refused: need {_b(need)}, available {_b(max(0, available))} "
                f"(MemAvailable minus {_b(self.headroom)} headroom"
                + (f" minus {_b(inflight)} being allocated" if inflight else "")
                + ")",
                reason="budget",
            )
        limit = cgroup.memory_limit()
        if limit is not None and need > limit.free - inflight:
            room = max(0, limit.free - inflight)
            raise AllocationError(
                f"budget refused: need {_b(need)}, cgroup allows {_b(room)}"
                f" more (limit {_b(limit.limit)} minus usage {_b(limit.usage)}, {limit.source})",
                reason="budget",
            )

    def _check_hugetlb(self, need: int, size: int) -> None:
        inflight = self._inflight_huge.get(size, 0)
        pool = kernel.hugepage_pool(size)
        free = (pool.available * size if pool else 0) - inflight
        if need > free:
            pages = -(-need // size)
            raise AllocationError(
                f"budget refused: need {pages} hugepages of {format_size(size)} ({_b(need)}), "
                f"{max(0, free) // size} free (free minus reserved"
                + (f", minus {inflight // size} being allocated" if inflight else "")
                + f"); reserve more in /sys/kernel/mm/hugepages/hugepages-{size // 1024}kB/"
                "nr_hugepages",
                reason="hugepages",
            )
        label = f"{size >> 20}MB" if size < 1 << 30 else f"{size >> 30}GB"
        limit = cgroup.hugetlb_limit(label)
        if limit is not None and need > limit.free - inflight:
            raise AllocationError(
                f"budget refused: need {_b(need)} of {label} hugepages, hugetlb cgroup allows "
                f"{_b(max(0, limit.free - inflight))} (limit {_b(limit.limit)}, {limit.source})",
                reason="hugepages",
            )

    def limit_bytes(self) -> int | None:
        return self.policy.limit_bytes() if self.policy is not None else None

    def effective_limit(self) -> int:
        """What is held plus what may still be allocated with normal pages, now."""
        held = self._held_bytes()
        room = kernel.meminfo().get("MemAvailable", 0) - self.headroom - self._inflight
        limit = cgroup.memory_limit()
        if limit is not None:
            room = min(room, limit.free - self._inflight)
        if self.policy is not None:
            room = min(room, self.policy.limit_bytes() - held - self._inflight)
        return held + self._inflight + max(0, room)

    def reserved_bytes(self) -> int:
        """Bytes reserved against the budget: held plus in flight (or the policy's view,
        for a policy that spans processes)."""
        if self.policy is not None and not isinstance(self.policy, FixedBudget):
            return self.policy.reserved_bytes()
        return self._held_bytes() + self._inflight
