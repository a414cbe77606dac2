"""The host view as Prometheus metrics (`hostpool exporter --node`): every shared-memory
object on the host, whoever made it, from one `scan_host()` per scrape.

| metric | labels | meaning |
| --- | --- | --- |
| `hostpool_host_shm_bytes` | engine, kind, state, area, pod_uid | resident bytes (no hugetlb) |
| `hostpool_host_shm_objects` | engine, kind, state, area, pod_uid | objects (no hugetlb) |
| `hostpool_host_hugetlb_bytes` | engine, kind, state | resident bytes of hugetlb objects |
| `hostpool_host_shmem_bytes` | | /proc/meminfo `Shmem` |
| `hostpool_host_shmem_unattributed_bytes` | | `Shmem` no object found accounts for |
| `hostpool_host_shm_oldest_orphan_age_seconds` | engine | age of the engine's oldest orphan |
| `hostpool_host_scrape_duration_seconds` | | time this scrape spent reading the view |
| `hostpool_host_scrape_truncated` | | 1 when the reading hit its time budget |
| `hostpool_host_unreadable_processes` | | processes this exporter may not read |

Label values come only from the fixed sets of `hostpool.host.model` (`ENGINES`,
`OBJECT_KINDS`, the two hold states, `AREAS` or "" for objects that have none) and the
uids of the pods on this node (`pod_uid`, "" for objects of no pod or of pods that
disagree: `hostpool.host.pods`), and a series exists only for a combination that has
objects now: bounded by the pods on the node, whatever their processes name. Never a
pid, a path or an object name (any process names its objects as it likes); pods' names
come from kube-state-metrics' `kube_pod_info`, joined on `uid` by a recording rule.

Bytes are resident bytes, the pages each object holds, not its size. Hugetlb objects are
not `Shmem`: they have their own family, so that `sum(hostpool_host_shm_bytes)` is the
attributed part of `hostpool_host_shmem_bytes` and, with the unattributed bytes, closes
on it. The oldest-orphan age counts every orphan, hugetlb ones too, whose age is known.

Scrapes that arrive while a reading runs share it (`metrics/flight`). The reading has a
time budget (`scrape_budget`); past it the scrape answers with what was read and
`hostpool_host_scrape_truncated` 1 (logged once, `hostpool.exporter_scrape_truncated`).
Processes this user may not read are counted, and logged once
(`hostpool.exporter_unreadable`): what only they hold looks orphaned, or unattributed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hostpool.base import events
from hostpool.errors import ConfigError
from hostpool.host.model import AREAS, ENGINES, OBJECT_KINDS, HoldState, HostView
from hostpool.metrics.flight import SharedFlight

DEFAULT_SCRAPE_BUDGET = 5.0  # seconds; Prometheus' default scrape_timeout is 10 s
STATES: Final[tuple[HoldState, ...]] = ("held", "orphaned")
OBJECT_LABELS: Final = ("engine", "kind", "state")
SHM_LABELS: Final = (*OBJECT_LABELS, "area", "pod_uid")

# name -> (labels, help). The catalogue in metrics/README.md is checked against it.
HOST_METRICS: Final[dict[str, tuple[tuple[str, ...], str]]] = {
    "hostpool_host_shm_bytes": (
        SHM_LABELS,
        "Resident bytes of the host's shared-memory objects (memfd, tmpfs file, SysV, "
        "anonymous shared), by engine, kind, state (held or orphaned), a file's area and "
        'the pod (uid; "" where none); hugetlb objects are left out (not Shmem).',
    ),
    "hostpool_host_shm_objects": (
        SHM_LABELS,
        "The host's shared-memory objects, one per inode, by engine, kind, state, area "
        "and pod uid; hugetlb objects are left out.",
    ),
    "hostpool_host_hugetlb_bytes": (
        OBJECT_LABELS,
        "Resident bytes of shared-memory objects backed by hugetlb pages (not part of "
        "Shmem), by engine, kind and state.",
    ),
    "hostpool_host_shmem_bytes": ((), "Shmem of /proc/meminfo."),
    "hostpool_host_shmem_unattributed_bytes": (
        (),
        "Shmem minus the resident bytes of the objects found (never negative): memory "
        "of processes or tmpfs mounts this exporter cannot read, or of the kernel.",
    ),
    "hostpool_host_shm_oldest_orphan_age_seconds": (
        ("engine",),
        "Seconds since the engine's oldest orphan (an object no process holds) last "
        "changed; only engines with orphans.",
    ),
    "hostpool_host_scrape_duration_seconds": ((), "Seconds this scrape spent reading."),
    "hostpool_host_scrape_truncated": (
        (),
        "1 when this scrape reached its time budget (--scrape-budget) before reading the "
        "whole host: the other hostpool_host_ gauges are then partial.",
    ),
    "hostpool_host_unreadable_processes": (
        (),
        "Processes this exporter may not read (it lacks CAP_SYS_PTRACE or "
        "CAP_DAC_READ_SEARCH, a hidepid /proc): objects only they hold show as orphaned "
        "or unattributed.",
    ),
}

Samples = dict[str, dict[tuple[str, ...], float]]
Scan = Callable[..., HostView]  # scan_host's shape: (*, deadline: float | None) -> HostView


def view_samples(view: HostView) -> Samples:
    """The object and total families' samples of one view, {name: {label values: value}},
    in the fixed sets' order (pods by uid); only combinations that have objects."""
    shm: defaultdict[tuple[str, ...], int] = defaultdict(int)
    count: defaultdict[tuple[str, ...], int] = defaultdict(int)
    huge: defaultdict[tuple[str, ...], int] = defaultdict(int)
    oldest: dict[str, float] = {}
    for obj in view.objects:
        if obj.hugetlb:
            huge[(obj.engine, obj.kind, obj.state)] += obj.resident_bytes
        else:
            key = (obj.engine, obj.kind, obj.state, obj.area or "", obj.pod_uid or "")
            shm[key] += obj.resident_bytes
            count[key] += 1
        if obj.orphan and obj.age_seconds is not None:
            oldest[obj.engine] = max(oldest.get(obj.engine, 0.0), obj.age_seconds)
    return {
        "hostpool_host_shm_bytes": {key: float(shm[key]) for key in sorted(count, key=_rank)},
        "hostpool_host_shm_objects": {key: float(count[key]) for key in sorted(count, key=_rank)},
        "hostpool_host_hugetlb_bytes": {key: float(huge[key]) for key in sorted(huge, key=_rank)},
        "hostpool_host_shmem_bytes": {(): float(view.totals.shmem_bytes)},
        "hostpool_host_shmem_unattributed_bytes": {(): float(view.totals.unattributed_bytes)},
        "hostpool_host_shm_oldest_orphan_age_seconds": {
            (engine,): oldest[engine] for engine in ENGINES if engine in oldest
        },
    }


_ORDERS: Final = tuple({v: i for i, v in enumerate(values)} for values in
                       (ENGINES, OBJECT_KINDS, STATES, ("", *AREAS)))  # fmt: skip


def _rank(key: tuple[str, ...]) -> tuple[object, ...]:
    """A series' place: the fixed sets' order, then the pod's uid."""
    return (*(order[v] for order, v in zip(_ORDERS, key, strict=False)), *key[len(_ORDERS) :])


class HostCollector(Collector):
    """Exports the host view, reading it with `scan` (`hostpool.host.scan.scan_host` unless
    given: a test's stand-in) for at most `scrape_budget` seconds per scrape."""

    def __init__(
        self, *, scrape_budget: float = DEFAULT_SCRAPE_BUDGET, scan: Scan | None = None
    ) -> None:
        if not scrape_budget > 0:
            raise ConfigError("scrape_budget must be a positive number of seconds")
        if scan is None:
            from hostpool.host.scan import scan_host  # /proc is read only once scraped

            scan = scan_host
        self.scrape_budget = scrape_budget
        self._scan = scan
        self._flight: SharedFlight[list[Metric]] = SharedFlight()
        self._was_truncated = False
        self._warned_unreadable = False

    def describe(self) -> Iterable[Metric]:
        return [_family(name) for name in HOST_METRICS]

    def collect(self) -> Iterable[Metric]:
        return self._flight.run(self._collect_once)

    def _collect_once(self) -> list[Metric]:
        started = time.perf_counter()
        deadline = time.monotonic() + self.scrape_budget
        view = self._scan(deadline=deadline)
        truncated = not view.complete  # the scan stopped at the deadline with what it read
        samples = view_samples(view)
        elapsed = time.perf_counter() - started
        samples["hostpool_host_scrape_duration_seconds"] = {(): elapsed}
        samples["hostpool_host_scrape_truncated"] = {(): 1.0 if truncated else 0.0}
        samples["hostpool_host_unreadable_processes"] = {(): float(view.unreadable)}
        if view.unreadable and not self._warned_unreadable:
            self._warned_unreadable = True
            events.warning(
                "hostpool.exporter_unreadable",
                view="node",
                processes=view.unreadable,
                detail="what only these processes hold shows as orphaned or unattributed: "
                "the exporter needs CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (in a container, "
                "the host's PID namespace too) to read every process; `hostpool inspect "
                "PID` says what is missing for one",
            )
        if truncated and not self._was_truncated:
            events.warning(
                "hostpool.exporter_scrape_truncated",
                view="node",
                budget_s=self.scrape_budget,
                seconds=round(elapsed, 3),
                objects_read=len(view.objects),
                detail="the node view was cut short: its sums are partial and its "
                "unattributed bytes too high; raise --scrape-budget (below Prometheus' "
                "scrape_timeout)",
            )
        self._was_truncated = truncated
        families: list[Metric] = []
        for name in HOST_METRICS:
            family = _family(name)
            for labels, value in samples[name].items():
                family.add_metric(list(labels), value)
            families.append(family)
        return families


def _family(name: str) -> GaugeMetricFamily:
    labels, doc = HOST_METRICS[name]
    return GaugeMetricFamily(name, doc, labels=labels)
