"""Prometheus metrics of *other* processes' shared memory, read from /proc at scrape time.

For servers that do not embed hostpool (stock sglang with `sglang_host_pool_` memfds, or
any process using hostpool-named memfds): `hostpool exporter --match PREFIX` or
`--pid PID` serves these gauges, summed over the matched processes:

| metric | labels | meaning |
| --- | --- | --- |
| `hostpool_exporter_open_fds` | prefix, pool | fds referring to matching shm objects |
| `hostpool_exporter_mapped_bytes` | prefix, pool | bytes of their mappings |
| `hostpool_exporter_resident_bytes` | prefix, pool | of those, bytes in memory (Rss + hugetlb) |
| `hostpool_exporter_mappings` | prefix, pool | mappings (VMAs split by madvise count once) |
| `hostpool_exporter_processes` | prefix | processes holding a matching fd or mapping |
| `hostpool_exporter_scrape_duration_seconds` | | time this scrape spent reading /proc |

Sums over processes count an object shared by two processes twice (each maps it).
Processes this user may not read are skipped (run as root or as the server's user);
the first scrape that meets one logs `hostpool.exporter_unreadable`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hostpool import events, procfs, procgroup

LABELS = ["prefix", "pool"]


@dataclass
class _Totals:
    open_fds: int = 0
    mapped_bytes: int = 0
    resident_bytes: int = 0
    mappings: int = 0


class ProcfsCollector(Collector):
    """Exports one process (`pid`, every known prefix) or all processes matching `match`."""

    def __init__(self, *, pid: int | None = None, match: Sequence[str] = ()) -> None:
        if (pid is None) == (not match):
            raise ValueError("ProcfsCollector needs exactly one of pid= or match=")
        self.pid = pid
        self.prefixes = tuple(match) if match else procfs.KNOWN_PREFIXES
        self._warned_unreadable = False

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        started = time.perf_counter()
        processes = self._processes()
        totals: dict[tuple[str, str], _Totals] = {}
        holders = dict.fromkeys(self.prefixes, 0)
        for process in processes:
            seen: set[str] = set()
            for usage in procgroup.pool_usage(procgroup.group_objects(process)):
                t = totals.setdefault((usage.prefix, usage.pool), _Totals())
                t.open_fds += usage.open_fds
                t.mapped_bytes += usage.mapped_bytes
                t.resident_bytes += usage.resident_bytes
                t.mappings += usage.mappings
                seen.add(usage.prefix)
            for prefix in seen:
                holders[prefix] += 1
        fds, mapped, resident, mappings, procs, duration = self._families()
        for (prefix, pool), t in sorted(totals.items()):
            fds.add_metric([prefix, pool], t.open_fds)
            mapped.add_metric([prefix, pool], t.mapped_bytes)
            resident.add_metric([prefix, pool], t.resident_bytes)
            mappings.add_metric([prefix, pool], t.mappings)
        for prefix, count in holders.items():
            procs.add_metric([prefix], count)
        duration.add_metric([], time.perf_counter() - started)
        return [fds, mapped, resident, mappings, procs, duration]

    def _processes(self) -> list[procfs.ProcessShm]:
        if self.pid is not None:
            try:
                return [procfs.read_process(self.pid, self.prefixes)]
            except procfs.ProcessNotFoundError:
                return []  # it exited: the gauges drop to nothing, processes to 0
            except procfs.ProcessAccessError as exc:
                self._warn_unreadable(1, str(exc))
                return []
        result = procgroup.scan(self.prefixes)
        if result.unreadable:
            self._warn_unreadable(result.unreadable, "run as root or as the servers' user")
        return result.processes

    def _warn_unreadable(self, count: int, detail: str) -> None:
        if not self._warned_unreadable:
            self._warned_unreadable = True
            events.warning("hostpool.exporter_unreadable", processes=count, detail=detail)

    @staticmethod
    def _families() -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "hostpool_exporter_open_fds",
            "Open fds referring to matching shared-memory objects, summed over processes.",
            labels=LABELS,
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_mapped_bytes",
            "Bytes of mappings of matching shared-memory objects, summed over processes.",
            labels=LABELS,
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_resident_bytes",
            "Of the mapped bytes, those backed by memory now (Rss plus hugetlb pages).",
            labels=LABELS,
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_mappings",
            "Mappings of matching shared-memory objects, summed over processes.",
            labels=LABELS,
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_processes",
            "Processes holding a matching shared-memory fd or mapping.",
            labels=["prefix"],
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_scrape_duration_seconds",
            "Seconds this scrape spent reading /proc.",
        )
