"""Admission control: a request is refused before any mmap when it cannot fit.

Every allocation path is admitted here, managed or not: a manager's Admission, or the
process-wide one plain allocators and `alloc_shm` share (no configured budget: only what
the kernel would refuse later, by the OOM killer, is refused now, as `no_memory`).

Normal pages: min(explicit budget or policy, MemAvailable minus a headroom, cgroup limit
minus usage, read from the cgroup the process is in now). Hugetlb-backed requests: the
explicit budget or policy, free minus reserved pages of that size and the hugetlb cgroup
limit (reserved hugepages are already gone from MemAvailable).

A reservation is taken under one lock and held across the mmap; it turns into held bytes
atomically (`Reservation.commit` records the region under the same lock), so concurrent
allocations neither jointly overshoot nor count one region twice.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hostpool.base.locks import ForkSafeLock
from hostpool.base.units import format_size
from hostpool.errors import AllocationError, InvalidRequestError
from hostpool.memory import cgroup, kernel
from hostpool.memory.kernel import failure_from_oserror
from hostpool.words import FailureReason

# The `limit` label of hostpool_budget_bytes: every limit that can bind.
LIMITS = ("configured", "memavailable", "cgroup", "host", "hugetlb")


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
            raise _refusal(
                f"budget refused: need {_b(need)} with {_b(held)} already held, budget "
                f"{_b(self.limit)} (explicit budget)",
                ("budget", need, self.limit - held, self.limit),
            )

    def reserved_bytes(self) -> int:
        return 0  # the Admission that owns it knows what is held


def _b(n: int) -> str:
    return f"{n} bytes ({format_size(n)})"


def _refusal(message: str, figures: tuple[FailureReason, int, int, int | None]) -> AllocationError:
    """The AllocationError of a refused admission: `figures` is (reason, bytes needed,
    bytes the refusing limit has left, that limit or None); what is left is never below 0."""
    reason, need, available, limit = figures
    return AllocationError(
        message,
        reason=reason,
        need_bytes=need,
        available_bytes=max(0, available),
        limit_bytes=limit,
    )


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


# Each ledger's admissions (its managers' and its allocators' outside any manager), held
# weakly: a dropped manager drops out. Read by the collector for hostpool_budget_bytes.
_admissions: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Admission]] = (
    weakref.WeakKeyDictionary()
)
_admissions_lock = ForkSafeLock()


def register_admission(ledger: Any, admission: Admission) -> None:
    """Count `admission` among the limits over `ledger`'s regions (held weakly)."""
    with _admissions_lock:
        _admissions.setdefault(ledger, weakref.WeakSet()).add(admission)


def unregister_admission(ledger: Any, admission: Admission) -> None:
    """Forget an admission registered with `register_admission`; no error if it was not."""
    with _admissions_lock:
        _admissions.get(ledger, weakref.WeakSet()).discard(admission)


_process_admissions: weakref.WeakKeyDictionary[Any, Admission] = weakref.WeakKeyDictionary()
_process_admissions_lock = ForkSafeLock()


def process_admission(ledger: Any) -> Admission:
    """The admission of allocators outside any manager: no configured budget, but what
    the kernel would refuse later (MemAvailable, the cgroup) is refused now, typed."""
    with _process_admissions_lock:
        admission = _process_admissions.get(ledger)
        if admission is None:
            admission = Admission(None, ledger.held_bytes, kernel_reason="no_memory")
            _process_admissions[ledger] = admission
            register_admission(ledger, admission)
        return admission


def admissions(ledger: Any) -> list[Admission]:
    """The live admissions registered for `ledger`."""
    with _admissions_lock:
        return list(_admissions.get(ledger, ()))


def default_headroom() -> int:
    """Memory left for everything else: 5% of RAM, at least 256 MiB, at most 4 GiB."""
    total = kernel.meminfo().get("MemTotal", 0)
    return min(4 << 30, max(256 << 20, total // 20))


class Reservation:
    """Bytes reserved for one allocation; `commit` turns them into held bytes."""

    __slots__ = ("_admission", "committed", "hugetlb_page_size", "need")

    def __init__(self, admission: Admission, need: int, hugetlb_page_size: int | None) -> None:
        self._admission = admission
        self.need = need
        self.hugetlb_page_size = hugetlb_page_size
        self.committed = False

    def commit(self, record: Callable[[], None]) -> None:
        """Run `record` (which makes the bytes held) and drop the reservation, atomically:
        no admission sees the bytes both held and in flight, or neither."""
        self._admission.commit(self, record)


class Admission:
    """Reserves bytes under a lock for the duration of an allocation."""

    def __init__(
        self,
        policy: BudgetPolicy | None,
        held_bytes: Callable[[], int],
        *,
        headroom: int | None = None,
        kernel_reason: FailureReason = "budget",
    ) -> None:
        self.policy = policy
        self._held_bytes = held_bytes
        self._headroom = headroom  # read lazily: constructing reads nothing from /proc
        # Refusals by MemAvailable or the cgroup: part of a manager's budget ("budget");
        # for a plain allocator, what the kernel would refuse anyway ("no_memory").
        self.kernel_reason = kernel_reason
        self._lock = ForkSafeLock()
        self._inflight = 0
        self._inflight_huge: dict[int, int] = {}

    @property
    def headroom(self) -> int:
        if self._headroom is None:
            self._headroom = default_headroom()
        return self._headroom

    @contextlib.contextmanager
    def reserve(self, need: int, hugetlb_page_size: int | None) -> Iterator[Reservation]:
        reservation = Reservation(self, need, hugetlb_page_size)
        with self._lock:
            try:
                if hugetlb_page_size is None:
                    self._check_normal(need)
                else:
                    self._check_hugetlb(need, hugetlb_page_size)
            except OSError as exc:  # /proc or /sys unreadable: EMFILE is the usual one
                raise failure_from_oserror(exc, f"admitting {need} bytes", need) from exc
            if hugetlb_page_size is None:
                self._inflight += need
            else:
                self._inflight_huge[hugetlb_page_size] = (
                    self._inflight_huge.get(hugetlb_page_size, 0) + need
                )
        try:
            yield reservation
        finally:
            if not reservation.committed:
                with self._lock:
                    self._unreserve(reservation)
            settle = getattr(self.policy, "settle", None)
            if settle is not None and hugetlb_page_size is None:
                # A policy spanning processes (the host-wide budget) shrinks its
                # reservation to what is held now: a failed allocation keeps nothing.
                settle(self._held_bytes() + self._inflight)

    def commit(self, reservation: Reservation, record: Callable[[], None]) -> None:
        """Run `record` and release `reservation` under this admission's lock (see
        `Reservation.commit`)."""
        with self._lock:
            record()
            self._unreserve(reservation)

    def _unreserve(self, reservation: Reservation) -> None:
        if reservation.committed:
            return
        reservation.committed = True
        if reservation.hugetlb_page_size is None:
            self._inflight -= reservation.need
        else:
            self._inflight_huge[reservation.hugetlb_page_size] -= reservation.need

    def _check_policy(self, need: int) -> None:
        if self.policy is not None:
            inflight = self._inflight + sum(self._inflight_huge.values())
            self.policy.admit(need, self._held_bytes() + inflight)

    def _check_normal(self, need: int) -> None:
        inflight = self._inflight
        self._check_policy(need)
        available = kernel.meminfo().get("MemAvailable", 0) - self.headroom - inflight
        if need > available:
            raise _refusal(
                f"{self._refused()}: need {_b(need)}, available {_b(max(0, available))} "
                f"(MemAvailable minus {_b(self.headroom)} headroom"
                + (f" minus {_b(inflight)} being allocated" if inflight else "")
                + ")",
                (self.kernel_reason, need, available, None),
            )
        limit = cgroup.memory_limit()
        if limit is not None and need > limit.free - inflight:
            room = max(0, limit.free - inflight)
            raise _refusal(
                f"{self._refused()}: need {_b(need)}, cgroup allows {_b(room)}"
                f" more (limit {_b(limit.limit)} minus usage {_b(limit.usage)}, {limit.source})",
                (self.kernel_reason, need, room, limit.limit),
            )

    def _refused(self) -> str:
        return "budget refused" if self.kernel_reason == "budget" else "refused"

    def _check_hugetlb(self, need: int, size: int) -> None:
        self._check_policy(need)
        inflight = self._inflight_huge.get(size, 0)
        pool = kernel.hugepage_pool(size)
        free = (pool.available * size if pool else 0) - inflight
        if need > free:
            pages = -(-need // size)
            raise _refusal(
                f"budget refused: need {pages} hugepages of {format_size(size)} ({_b(need)}), "
                f"{max(0, free) // size} free (free minus reserved"
                + (f", minus {inflight // size} being allocated" if inflight else "")
                + f"); reserve more in /sys/kernel/mm/hugepages/hugepages-{size // 1024}kB/"
                "nr_hugepages",
                ("hugepages", need, free, None),
            )
        limit = cgroup.hugetlb_limit(_hugetlb_label(size))
        if limit is not None and need > limit.free - inflight:
            raise _refusal(
                f"budget refused: need {_b(need)} of {_hugetlb_label(size)} hugepages, "
                f"hugetlb cgroup allows {_b(max(0, limit.free - inflight))} "
                f"(limit {_b(limit.limit)}, {limit.source})",
                ("hugepages", need, limit.free - inflight, limit.limit),
            )

    def limit_bytes(self) -> int | None:
        return self.policy.limit_bytes() if self.policy is not None else None

    def inflight_bytes(self) -> int:
        return self._inflight + sum(self._inflight_huge.values())

    def configured_room(self) -> int | None:
        """Room an explicit byte budget leaves now (None without one)."""
        if not isinstance(self.policy, FixedBudget):
            return None
        return self.policy.limit - self._held_bytes() - self.inflight_bytes()

    def reserved_bytes(self) -> int:
        """Bytes reserved against the budget: held plus in flight (or the policy's view,
        for a policy that spans processes)."""
        if self.policy is not None and not isinstance(self.policy, FixedBudget):
            return self.policy.reserved_bytes()
        return self._held_bytes() + self.inflight_bytes()


def _hugetlb_label(size: int) -> str:
    return f"{size >> 20}MB" if size < 1 << 30 else f"{size >> 30}GB"


@dataclass(frozen=True)
class BudgetView:
    """What hostpool may still reserve, per limit, and what it reserves now.

    `limits[name]` is the reserved bytes plus the room that limit leaves now (for
    `configured`, the explicit budget of the manager with the least room left), capped at
    what the host (MemTotal) or the cgroup holds: the smallest one binds. One value per
    limit, never a sum over managers. `reserved` is what this process's allocations hold
    plus what is being allocated.
    """

    limits: dict[str, int]
    reserved: int

    @property
    def binding(self) -> str | None:
        """The limit normal-page requests meet first (`hugetlb` binds hugetlb ones only)."""
        normal = {k: v for k, v in self.limits.items() if k != "hugetlb"}
        return min(normal, key=normal.__getitem__) if normal else None


def budget_view(admissions: list[Any], held_total: int) -> BudgetView:
    """The budget as every limit that applies sees it (for metrics and /debug/pools)."""
    inflight = sum(a.inflight_bytes() for a in admissions)
    reserved = held_total + inflight
    info = kernel.meminfo()
    ceiling = info.get("MemTotal", 0)
    rooms: dict[str, int] = {}
    headroom = max((a.headroom for a in admissions), default=default_headroom())
    rooms["memavailable"] = info.get("MemAvailable", 0) - headroom - inflight
    limit = cgroup.memory_limit()
    if limit is not None:
        ceiling = min(ceiling, limit.limit)
        rooms["cgroup"] = limit.free - inflight
    fixed = [a for a in admissions if isinstance(a.policy, FixedBudget)]
    explicit: int | None = None
    if fixed:
        # The explicit budget of the manager with the least room left (per manager).
        tightest = min(fixed, key=lambda a: a.configured_room())
        explicit = tightest.policy.limit
    hosts = {id(a.policy): a.policy for a in admissions}
    host_rooms = [
        p.limit_bytes() - p.reserved_bytes()
        for p in hosts.values()
        if p is not None and not isinstance(p, FixedBudget)
    ]
    if host_rooms:
        rooms["host"] = min(host_rooms)
    huge_room = 0
    for size, pool in kernel.hugepage_pools().items():
        if pool.total == 0:
            continue
        room = pool.available * size
        hl = cgroup.hugetlb_limit(_hugetlb_label(size))
        huge_room += room if hl is None else min(room, hl.free)
        rooms["hugetlb"] = huge_room
    limits = {name: min(ceiling, reserved + max(0, room)) for name, room in rooms.items()}
    if explicit is not None:
        limits["configured"] = min(ceiling, explicit)
    return BudgetView({k: limits[k] for k in LIMITS if k in limits}, reserved)
