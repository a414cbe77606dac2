"""Prometheus metrics, collected from the process ledger at scrape time.

`HostPoolCollector` follows prometheus_client's Collector protocol: `describe()` for
registration, `collect()` reading the ledger afresh. Nothing starts on import; any
registry can be passed. In multiprocess mode (PROMETHEUS_MULTIPROC_DIR, as vLLM and
sglang run) custom collectors are ignored, so `MultiprocessPublisher` publishes the same
names as plain metrics with explicit `multiprocess_mode`, refreshed by a thread.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from hostpool._version import __version__
from hostpool.base import fork
from hostpool.base.locks import ForkSafeLock
from hostpool.base.units import format_size
from hostpool.core.budget import LIMITS, admissions, budget_view
from hostpool.core.ledger import Ledger, get_ledger
from hostpool.core.records import DURATION_BUCKETS
from hostpool.memory import kernel
from hostpool.share.peers import attached_clients
from hostpool.words import FAILURE_REASONS, FALLBACK_REASONS, POPULATE_MODES, RELEASE_HOWS

# Why a multiprocess publish failed: the errno families an operator can act on, else other.
PUBLISH_ERROR_KINDS = ("fd_limit", "no_space", "permission", "os_error", "other")

# name -> (type, labels, help). The catalogue in metrics/README.md is checked against it.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "hostpool_allocated_bytes": (
        "gauge",
        ("pool", "allocator", "page_size"),
        "Bytes mapped by live allocations, by backing page size.",
    ),
    "hostpool_resident_bytes": (
        "gauge",
        ("pool", "allocator", "page_size"),
        "Of the allocated bytes, those backed by memory now (measured at scrape).",
    ),
    "hostpool_released_mapped_bytes": (
        "gauge",
        ("pool",),
        "Bytes of released regions still mapped by live views.",
    ),
    "hostpool_open_fds": (
        "gauge",
        ("pool",),
        "File descriptors the process holds for the pool, mmap's internal dup included.",
    ),
    "hostpool_live_allocations": ("gauge", ("pool", "allocator"), "Live allocations."),
    "hostpool_allocations": ("counter", ("pool", "allocator"), "Allocations made."),
    "hostpool_allocation_failures": (
        "counter",
        ("pool", "reason"),
        "Allocations refused or failed, by reason: " + ", ".join(FAILURE_REASONS) + ".",
    ),
    "hostpool_releases": (
        "counter",
        ("pool", "how"),
        "Regions released: explicit (close(), release(), mm.close()); tensor (handed to "
        "its tensor by contract and ended with it: normal); finalizer (an owner that should "
        "have released it was collected first: the leak signal).",
    ),
    "hostpool_hugepage_fallbacks": (
        "counter",
        ("pool", "reason"),
        "Hugepages asked for and not used, by reason: " + ", ".join(FALLBACK_REASONS) + ".",
    ),
    "hostpool_populate_mode": (
        "gauge",
        ("pool", "mode"),
        "Live allocations of the pool populated in each mode.",
    ),
    "hostpool_pinned_bytes": ("gauge", ("pool",), "Bytes registered with CUDA."),
    "hostpool_allocation_duration_seconds": (
        "histogram",
        ("pool",),
        "Allocate plus populate time.",
    ),
    "hostpool_budget_bytes": (
        "gauge",
        ("limit",),
        "Per limit that applies (" + ", ".join(LIMITS) + "): reserved bytes plus the room "
        "it leaves now, capped at what the host or cgroup holds; the smallest binds.",
    ),
    "hostpool_budget_reserved_bytes": (
        "gauge",
        (),
        "Bytes this process's allocations hold plus those being allocated.",
    ),
    "hostpool_fd_reuse_skips": (
        "counter",
        ("pool",),
        "fds not closed because their number named another file by then (a caller closed "
        "hostpool's fd and the kernel reused the number).",
    ),
    "hostpool_hugepages_free": (
        "gauge",
        ("page_size",),
        "Free minus reserved hugetlb pages per page size.",
    ),
    "hostpool_attached_clients": ("gauge", ("pool",), "Peers holding the pool through share."),
    "hostpool_publish_errors": (
        "counter",
        ("kind",),
        "Multiprocess publishes that failed, by kind: "
        + ", ".join(PUBLISH_ERROR_KINDS)
        + "; the publisher retries at its next interval.",
    ),
    "hostpool_scrape_duration_seconds": ("gauge", (), "Time this collector took."),
    "hostpool_build_info": ("gauge", ("version",), "hostpool's version; always 1."),
}


def _family(name: str) -> Any:
    kind, labels, doc = METRICS[name]
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    if kind == "histogram":
        return HistogramMetricFamily(name, doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


class HostPoolCollector(Collector):
    """Exports DESIGN's metric table from a ledger (the process's by default)."""

    def __init__(self, ledger: Ledger | None = None) -> None:
        self.ledger = ledger or get_ledger()

    def describe(self) -> Iterable[Metric]:
        return [_family(name) for name in METRICS]

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        families = {name: _family(name) for name in METRICS}
        for name, samples in measure(self.ledger).items():
            family = families[name]
            if METRICS[name][0] == "histogram":
                for labels, (buckets, total) in samples.items():
                    family.add_metric(list(labels), buckets, total)
            else:
                for labels, value in samples.items():
                    family.add_metric(list(labels), value)
        families["hostpool_scrape_duration_seconds"].add_metric([], time.perf_counter() - started)
        yield from families.values()


def measure(ledger: Ledger) -> dict[str, dict[tuple[str, ...], Any]]:
    """Every metric's samples as {name: {label values: value}}, read now.

    Resident bytes: fstat(fd).st_blocks for fd-backed regions (constant cost at any
    size, hugetlb pages included) and mincore for anonymous ones, never smaps (a page
    table walk); costs in docs/ARCHITECTURE.md, "Measurements". Never raises for a
    region released meanwhile: it counts 0.
    """
    counters = ledger.counters()
    pools: list[str] = counters.known_pools
    out: dict[str, dict[tuple[str, ...], Any]] = defaultdict(dict)
    allocated: dict[tuple[str, ...], float] = defaultdict(float)
    resident: dict[tuple[str, ...], float] = defaultdict(float)
    live: dict[tuple[str, ...], float] = defaultdict(float)
    for pool in pools:
        for name in (
            "hostpool_released_mapped_bytes",
            "hostpool_open_fds",
            "hostpool_pinned_bytes",
        ):
            out[name][(pool,)] = 0.0
        for mode in POPULATE_MODES:
            out["hostpool_populate_mode"][(pool, mode)] = 0.0
        for reason in FAILURE_REASONS:
            out["hostpool_allocation_failures"][(pool, reason)] = 0.0
        for how in RELEASE_HOWS:
            out["hostpool_releases"][(pool, how)] = 0.0
        for fallback in FALLBACK_REASONS:
            out["hostpool_hugepage_fallbacks"][(pool, fallback)] = 0.0
        out["hostpool_attached_clients"][(pool,)] = 0.0
    for (pool, allocator), n in counters.allocations_total.items():
        out["hostpool_allocations"][(pool, allocator)] = float(n)
        live[(pool, allocator)] += 0.0
    # What the ledger keeps up to date at each transition.
    for (pool, allocator, page_size), n in counters.live_bytes.items():
        key = (pool, allocator, _page_label(page_size))
        allocated[key] += n
        resident[key] += 0.0
    for (pool, allocator), n in counters.live_count.items():
        live[(pool, allocator)] += n
    for (pool, mode_used), n in counters.live_modes.items():
        out["hostpool_populate_mode"][(pool, mode_used)] = float(n)
    for pool, n in counters.live_pinned.items():
        out["hostpool_pinned_bytes"][(pool,)] = float(n)
    # What only the kernel knows, measured now: one fstat (or mincore) per region.
    open_fds: dict[tuple[str, ...], float] = defaultdict(float)
    released: dict[tuple[str, ...], float] = defaultdict(float)
    for entry in ledger.entries():  # the per-region loop: keep it tight (bench/scrape.py)
        region = entry.region
        state = entry.state
        if state == "released_shared":
            continue  # no longer mapped here; peers hold it (see the snapshot)
        keys = entry.scrape_keys
        if keys is None:
            pool = region.facts.pool
            keys = entry.scrape_keys = (
                (pool,),
                (pool, entry.allocator, _page_label(region.facts.page_size)),
            )
        pool_key, size_key = keys
        fds, resident_now = region.scrape()  # one fstat (or mincore), inode-checked
        open_fds[pool_key] += fds
        if state != "live":
            released[pool_key] += region.facts.mapped_bytes
        else:
            resident[size_key] += resident_now
    out["hostpool_open_fds"].update(open_fds)
    out["hostpool_released_mapped_bytes"].update(released)
    out["hostpool_allocated_bytes"] = dict(allocated)
    out["hostpool_resident_bytes"] = dict(resident)
    out["hostpool_live_allocations"] = dict(live)
    for (pool, reason), n in counters.failures_total.items():
        out["hostpool_allocation_failures"][(pool, reason)] = float(n)
    for (pool, how), n in counters.releases_total.items():
        out["hostpool_releases"][(pool, how)] = float(n)
    for (pool, fallback), n in counters.fallbacks_total.items():
        out["hostpool_hugepage_fallbacks"][(pool, fallback)] = float(n)
    for pool in pools:
        counts, total = counters.durations.get(pool, ([0] * (len(DURATION_BUCKETS) + 1), 0.0))
        cumulative, buckets = 0, []
        for bound, count in zip((*DURATION_BUCKETS, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        out["hostpool_allocation_duration_seconds"][(pool,)] = (buckets, total)
    for pool in pools:
        out["hostpool_fd_reuse_skips"][(pool,)] = 0.0
    for pool, n in counters.fd_reuse_skips.items():
        out["hostpool_fd_reuse_skips"][(pool,)] = float(n)
    view = budget_view(admissions(ledger), ledger.held_bytes())
    for limit, value in view.limits.items():
        out["hostpool_budget_bytes"][(limit,)] = float(value)
    out["hostpool_budget_reserved_bytes"][()] = float(view.reserved)
    for size, hp in sorted(kernel.hugepage_pools().items()):
        out["hostpool_hugepages_free"][(format_size(size),)] = float(hp.available)
    for pool, n in attached_clients(ledger).items():
        out["hostpool_attached_clients"][(pool,)] = float(n)
    with _publish_errors_lock:
        for kind in PUBLISH_ERROR_KINDS:
            out["hostpool_publish_errors"][(kind,)] = float(_publish_errors[kind])
    out["hostpool_build_info"][(__version__,)] = 1.0
    return out


# Failed multiprocess publishes of this process, by kind (hostpool.metrics.multiprocess counts them;
# they live here so every exposition path shows them).
_publish_errors: Counter[str] = Counter()
_publish_errors_lock = ForkSafeLock()


def count_publish_error(kind: str) -> None:
    """Count one failed multiprocess publish (`kind` from PUBLISH_ERROR_KINDS)."""
    with _publish_errors_lock:
        _publish_errors[kind if kind in PUBLISH_ERROR_KINDS else "other"] += 1


def publish_errors() -> dict[str, int]:
    """This process's failed publishes by kind (every kind present, zero included)."""
    with _publish_errors_lock:
        return {kind: _publish_errors[kind] for kind in PUBLISH_ERROR_KINDS}


def _reset_publish_errors_in_child() -> None:
    # A forked child counts its own publishes (its lock is already a fresh one).
    _publish_errors.clear()


fork.on_fork(__name__, after_in_child=_reset_publish_errors_in_child)


@functools.lru_cache(maxsize=16)
def _page_label(page_size: int) -> str:
    return format_size(page_size)


_registered: weakref.WeakKeyDictionary[CollectorRegistry, HostPoolCollector] = (
    weakref.WeakKeyDictionary()
)
_registered_lock = ForkSafeLock()


def register_metrics(
    registry: CollectorRegistry | None = None, *, ledger: Ledger | None = None
) -> HostPoolCollector:
    """Register the collector with `registry` (default: the global REGISTRY) once."""
    target = REGISTRY if registry is None else registry
    with _registered_lock:
        existing = _registered.get(target)
        if existing is not None:
            return existing
        collector = HostPoolCollector(ledger)
        target.register(collector)
        _registered[target] = collector
        return collector
