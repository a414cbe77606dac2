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
| `hostpool_host_scrape_truncated_phase` | phase | 1 for the phase the budget ran out in |
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
time budget (`scrape_budget`) that bounds each of its phases (`host/bounds`: mountinfo,
processes, tmpfs, sysv); past it the scrape answers with what was read,
`hostpool_host_scrape_truncated` 1 and the phase it stopped in
(`hostpool_host_scrape_truncated_phase`; logged once, `hostpool.exporter_scrape_truncated`).
The reading sums as the scan finds objects (`metrics/hostsum`): no object is kept, and
none is made for a file no process holds.
Processes this user may not read are counted, and logged once
(`hostpool.exporter_unreadable`): what only they hold looks orphaned, or unattributed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hostpool.base import events
from hostpool.errors import ConfigError
from hostpool.host.bounds import PHASES
from hostpool.host.model import HostView
from hostpool.metrics.flight import SharedFlight
from hostpool.metrics.hostsum import HostSums, Samples, view_samples

DEFAULT_SCRAPE_BUDGET = 5.0  # seconds; Prometheus' default scrape_timeout is 10 s
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
    "hostpool_host_scrape_truncated_phase": (
        ("phase",),
        "1 for the phase of the scan (mountinfo, processes, tmpfs, sysv) in which this "
        "scrape's time budget ran out, 0 for the others (all 0: it did not).",
    ),
    "hostpool_host_unreadable_processes": (
        (),
        "Processes this exporter may not read (it lacks CAP_SYS_PTRACE or "
        "CAP_DAC_READ_SEARCH, a hidepid /proc): objects only they hold show as orphaned "
        "or unattributed.",
    ),
}

Scan = Callable[..., HostView]  # scan_host's shape: (*, deadline: float | None) -> HostView


class HostCollector(Collector):
    """Exports the host view, reading it with `scan` (`hostpool.host.scan.scan_host` unless
    given: a test's stand-in) for at most `scrape_budget` seconds per scrape."""

    def __init__(
        self, *, scrape_budget: float = DEFAULT_SCRAPE_BUDGET, scan: Scan | None = None
    ) -> None:
        if not scrape_budget > 0:
            raise ConfigError("scrape_budget must be a positive number of seconds")
        self._summing = scan is None  # the real scan sums as it goes; a stand-in gives a view
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
        samples: Samples
        if self._summing:
            sums = HostSums()
            view = self._scan(deadline=deadline, sink=sums)
            samples, objects_read = sums.samples(view.totals), sums.objects
        else:
            view = self._scan(deadline=deadline)
            samples, objects_read = view_samples(view), len(view.objects)
        truncated = not view.complete  # the scan stopped at the deadline with what it read
        elapsed = time.perf_counter() - started
        samples["hostpool_host_scrape_duration_seconds"] = {(): elapsed}
        samples["hostpool_host_scrape_truncated"] = {(): 1.0 if truncated else 0.0}
        samples["hostpool_host_scrape_truncated_phase"] = {
            (phase,): 1.0 if phase == view.truncated_phase else 0.0 for phase in PHASES
        }
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
                phase=view.truncated_phase,
                objects_read=objects_read,
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
