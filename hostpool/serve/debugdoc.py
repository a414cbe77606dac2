"""The /debug/pools document of `hostpool serve`: JSON for people and for tools.

Sizes stay exact byte counts (a tool sums them); what a person would otherwise have to
decode is spelled out: seals as the names of their F_SEAL_* bits, times as ISO-8601 UTC
strings (plus `uptime_seconds`, the one number a tool needs), addresses in hex. Each
region and each pool carries its resident bytes, measured now as the collector measures
them (`Region.scrape`: one fstat of st_blocks per fd-backed region, mincore otherwise).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterable
from typing import Any

from hostpool.base.units import iso_utc
from hostpool.core.manager import PoolManager
from hostpool.core.records import AllocationRecord

# The F_SEAL_* bits (fcntl(2)), lowest first; Python 3.11's fcntl lacks the last two.
SEAL_NAMES: tuple[tuple[int, str], ...] = (
    (fcntl.F_SEAL_SEAL, "seal"),
    (fcntl.F_SEAL_SHRINK, "shrink"),
    (fcntl.F_SEAL_GROW, "grow"),
    (fcntl.F_SEAL_WRITE, "write"),
    (0x10, "future_write"),  # F_SEAL_FUTURE_WRITE, Linux 5.1
    (0x20, "exec"),  # F_SEAL_EXEC, Linux 6.3 (MFD_NOEXEC_SEAL sets it)
)
# The per-pool figures summed into `totals`.
POOL_FIGURES = ("allocations", "bytes", "released_mapped_bytes", "resident_bytes")


def seal_names(seals: int) -> list[str]:
    """The names of the F_SEAL_* bits set in `seals` (fcntl F_GET_SEALS), lowest bit
    first; a bit without a name as its hex value (`"0x40"`). Raises ValueError for a
    negative mask."""
    if seals < 0:
        raise ValueError(f"a seal mask is not negative, got {seals}")
    names = [name for bit, name in SEAL_NAMES if seals & bit]
    known = sum(bit for bit, _ in SEAL_NAMES)
    names += [hex(1 << i) for i in range(seals.bit_length()) if (seals & ~known) >> i & 1]
    return names


def region_document(record: AllocationRecord, resident_bytes: int) -> dict[str, Any]:
    """One region's record for /debug/pools: `seals` as names, `created_at` ISO UTC,
    `address` hex, `populate_seconds` to the microsecond, and `resident_bytes` as given."""
    doc = record.to_dict()
    doc["seals"] = seal_names(record.seals)
    doc["created_at"] = iso_utc(record.created_at)
    doc["address"] = hex(record.address)
    doc["populate_seconds"] = round(record.populate_seconds, 6)
    doc["resident_bytes"] = resident_bytes
    return doc


def _resident_by_id(manager: PoolManager, ids: set[int]) -> dict[int, int]:
    """Resident bytes now of the regions `ids` (0 for one no longer mapped here)."""
    out: dict[int, int] = {}
    for entry in manager.ledger.entries():
        region = entry.region
        if region.facts.id in ids:
            out[region.facts.id] = 0 if entry.state == "released_shared" else region.scrape()[1]
    return out


def pool_totals(
    totals: dict[str, dict[str, int]], regions: Iterable[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per pool: the manager's totals plus `resident_bytes` of its live regions."""
    out = {pool: {**t, "resident_bytes": 0} for pool, t in totals.items()}
    for r in regions:
        pool = out.setdefault(
            r["pool"],
            {"allocations": 0, "bytes": 0, "released_mapped_bytes": 0, "resident_bytes": 0},
        )
        if r["state"] == "live":
            pool["resident_bytes"] += r["resident_bytes"]
    return out


def debug_document(manager: PoolManager, started_at: float) -> dict[str, Any]:
    """What /debug/pools serves for `manager` of a server started at `started_at`
    (time.time()): pid, `started_at` (ISO UTC), `uptime_seconds`, `pools` (per pool:
    allocations, bytes, released_mapped_bytes, resident_bytes; and from the lease ledger
    `leases`: each part leased now with its holder's pid, uid and since, empty when none,
    `adopted_blocks` and `discarded_blocks` by reason), `totals` (the figures summed),
    the budget (the same numbers as hostpool_budget_bytes{limit} and
    hostpool_budget_reserved_bytes), and `regions` (every region's record)."""
    now = time.time()
    budget = manager.budget_view()
    records = manager.snapshot()
    resident = _resident_by_id(manager, {r.id for r in records})
    regions = [region_document(r, resident.get(r.id, 0)) for r in records]
    pools = pool_totals(manager.totals(), regions)
    for name, state in manager.leases.pools(list(pools)).items():
        pools[name].update(state.to_dict())
    return {
        "pid": os.getpid(),
        "started_at": iso_utc(started_at),
        "uptime_seconds": round(max(0.0, now - started_at), 3),
        "generated_at": iso_utc(now),
        "pools": pools,
        "totals": {k: sum(p[k] for p in pools.values()) for k in POOL_FIGURES},
        "budget_bytes": budget.limits[budget.binding] if budget.binding else None,
        "budget_binding_limit": budget.binding,
        "budget_limits": budget.limits,
        "budget_reserved_bytes": budget.reserved,
        "regions": regions,
    }
