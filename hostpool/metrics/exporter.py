"""Prometheus metrics of *other* processes' shared memory, read from /proc at scrape time.

For servers that do not embed hostpool (stock sglang with `sglang_host_pool_` memfds, or
any process using hostpool-named memfds): `hostpool exporter --match PREFIX` or
`--pid PID` serves these gauges, summed over the matched processes:

| metric | labels | meaning |
| --- | --- | --- |
| `hostpool_exporter_open_fds` | prefix, pool | fds referring to matching shm objects |
| `hostpool_exporter_mapped_bytes` | prefix, pool | bytes of their mappings |
| `hostpool_exporter_resident_bytes` | prefix, pool | of those, bytes in memory (see below) |
| `hostpool_exporter_mappings` | prefix, pool | mappings (VMAs split by madvise count once) |
| `hostpool_exporter_pools_folded` | prefix | pools summed into `pool="_other"` (over the cap) |
| `hostpool_exporter_processes` | prefix | `--match` only: processes holding a match that counts |
| `hostpool_exporter_ignored_objects` | prefix, reason | objects read, left out of every pool |
| `hostpool_exporter_target_up` | pid | `--pid` only: 1 while the process exists, else 0 |
| `hostpool_exporter_scrape_duration_seconds` | | time this scrape spent reading /proc |
| `hostpool_exporter_scrape_truncated` | | 1 when the scrape hit its time budget (partial sums) |

Only the prefixes the operator asked for (`--match`) appear; `--pid` watches every known
prefix but shows only those the process uses, and never exports
`hostpool_exporter_processes` (so `HostpoolExporterNoProcesses` means a `--match` found
nothing). Any user can name a memfd `hostpool.<anything>.1.1`: past `max_pools` pools
per prefix, the smallest (by resident, then mapped bytes) are summed into one
`pool="_other"` series, so the series count stays bounded.

Objects count by holder, not by name (`hostpool.proc.owners`): an object whose name
carries another process's pid counts only when that process holds the very same object
(then every holder counts: share clients, forked workers); a name with no pid (sglang's
`sglang_host_pool_<hex>`) counts by its name. The others are left out of every pool and
out of `hostpool_exporter_processes`, and counted in `hostpool_exporter_ignored_objects`
by reason (`owner_gone`, `not_held_by_owner`, `owner_other_uid`, `unverified`).

Resident bytes are the pages each mapped object holds (`st_blocks` through one of the
process's fds for it, at most the bytes the process maps of it; swapped-out shmem pages
included), the same measure as `hostpool_resident_bytes`; for an object a process maps
without holding an fd for it, the Rss and hugetlb pages of its mappings (smaps). Sums over
processes count an object shared by two processes twice (each maps it).
Processes this user may not read are skipped; the first scrape that meets one logs
`hostpool.exporter_unreadable` with their count, their pids (the first ten) and what
this process lacks to read the first one. A process that exits while it is
being read is skipped.

Each scrape reads /proc within a time budget (`scrape_budget`, default 5 s, half of
Prometheus' default scrape timeout): past it, the scrape returns what it read, with
`hostpool_exporter_scrape_truncated` 1 (and logs `hostpool.exporter_scrape_truncated`
when a scrape is first cut short after a complete one), rather than timing out with
nothing. Scrapes that arrive while one is reading /proc wait for it and share its result:
concurrent scrapers (an HA Prometheus pair, a flood) cost one pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hostpool.base import events
from hostpool.errors import ConfigError
from hostpool.metrics.flight import SharedFlight
from hostpool.proc import names, owners, procaccess, procfs, procgroup, scan
from hostpool.proc.textsafe import printable

LABELS = ["prefix", "pool"]
OTHER_POOL = "_other"
DEFAULT_SCRAPE_BUDGET = 5.0  # seconds; Prometheus' default scrape_timeout is 10 s

_Totals = procgroup.PoolTotals


class ProcfsCollector(Collector):
    """Exports one process (`pid`, every known prefix) or all processes matching `match`,
    with at most `max_pools` pool series per prefix, reading /proc for at most
    `scrape_budget` seconds per scrape."""

    def __init__(
        self,
        *,
        pid: int | None = None,
        match: Sequence[str] = (),
        max_pools: int,
        scrape_budget: float = DEFAULT_SCRAPE_BUDGET,
    ) -> None:
        if (pid is None) == (not match):
            raise ConfigError("ProcfsCollector needs exactly one of pid= or match=")
        if max_pools < 2:
            raise ConfigError("max_pools must be at least 2 (one pool and _other)")
        if not scrape_budget > 0:
            raise ConfigError("scrape_budget must be a positive number of seconds")
        self.pid = pid
        self.prefixes = tuple(match) if match else names.KNOWN_PREFIXES
        self.max_pools = max_pools
        self.scrape_budget = scrape_budget
        self._matcher = scan.Matcher(self.prefixes)
        self._warned_unreadable = False
        self._warned_folded: set[str] = set()
        self._was_truncated = False
        self._flight: SharedFlight[list[Metric]] = SharedFlight()

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        # concurrent scrapes share one pass over /proc (metrics/flight)
        return self._flight.run(self._collect_once)

    def _collect_once(self) -> list[Metric]:
        started = time.perf_counter()
        deadline = time.monotonic() + self.scrape_budget
        processes, ignored, target_up, truncated = self._processes(deadline)
        totals: dict[str, dict[str, _Totals]] = {}
        holders = dict.fromkeys(self.prefixes, 0)
        for pools_of_process in processes:
            seen: set[str] = set()
            for (prefix, pool), usage in pools_of_process.items():
                pools = totals.setdefault(prefix, {})
                pools.setdefault(pool, _Totals()).add(usage)
                seen.add(prefix)
            for prefix in seen:
                holders[prefix] += 1
        fds, mapped, resident, mappings, folded, procs, target, duration, cut, left_out = (
            self._families()
        )
        # --match: every prefix asked for; --pid: only the prefixes the process uses
        used = {prefix for prefix, _reason in ignored}.union(totals)
        prefixes = self.prefixes if self.pid is None else sorted(used)
        for prefix in prefixes:
            kept, n_folded = self._fold(prefix, totals.get(prefix, {}))
            for pool, t in kept:
                fds.add_metric([prefix, pool], t.open_fds)
                mapped.add_metric([prefix, pool], t.mapped_bytes)
                resident.add_metric([prefix, pool], t.resident_bytes)
                mappings.add_metric([prefix, pool], t.mappings)
            folded.add_metric([prefix], n_folded)
            for reason in owners.REASONS:
                left_out.add_metric([prefix, reason], ignored.get((prefix, reason), 0))
        if self.pid is None:
            for prefix, count in holders.items():
                procs.add_metric([prefix], count)
        else:
            target.add_metric([str(self.pid)], 1 if target_up else 0)
        elapsed = time.perf_counter() - started
        duration.add_metric([], elapsed)
        cut.add_metric([], 1 if truncated else 0)
        if truncated and not self._was_truncated:
            events.warning(
                "hostpool.exporter_scrape_truncated",
                budget_s=self.scrape_budget,
                seconds=round(elapsed, 3),
                processes_read=len(processes),
                detail="the scrape returned partial sums; raise --scrape-budget (below "
                "Prometheus' scrape_timeout) or narrow --match",
            )
        self._was_truncated = truncated
        return [fds, mapped, resident, mappings, folded, procs, target, duration, cut, left_out]

    def _fold(
        self, prefix: str, pools: dict[str, _Totals]
    ) -> tuple[list[tuple[str, _Totals]], int]:
        """The pools to export for `prefix` (at most max_pools series) and how many were
        summed into `_other`. The largest stay: a flood of empty names cannot push a real
        pool out without holding more memory than it."""
        if len(pools) <= self.max_pools:
            return sorted(pools.items()), 0
        ranked = sorted(
            pools.items(),
            key=lambda kv: (-kv[1].resident_bytes, -kv[1].mapped_bytes, -kv[1].open_fds, kv[0]),
        )
        kept = [(pool, t) for pool, t in ranked[: self.max_pools - 1] if pool != OTHER_POOL]
        other = _Totals()
        names = {pool for pool, _ in kept}
        for pool, t in pools.items():
            if pool not in names:
                other.add(t)
        n_folded = len(pools) - len(kept)
        if prefix not in self._warned_folded:
            self._warned_folded.add(prefix)
            events.warning(
                "hostpool.exporter_pools_folded",
                prefix=printable(prefix),
                pools=len(pools),
                kept=len(kept),
                folded=n_folded,
            )
        return [*sorted(kept), (OTHER_POOL, other)], n_folded

    def _processes(
        self, deadline: float
    ) -> tuple[
        list[dict[tuple[str, str], _Totals]], dict[tuple[str, owners.Reason], int], bool, bool
    ]:
        """Per-pool totals of each process to sum, the objects ignored per (prefix,
        reason), whether (for --pid) the target still exists, and whether the deadline
        cut the reading short."""
        if self.pid is not None:
            try:
                holdings = scan.read_holdings(self.pid, self._matcher, deadline=deadline)
            except procfs.ProcessNotFoundError:
                self._matcher.next_scan()
                return [], {}, False, False  # it exited: its gauges go, target_up drops to 0
            except procfs.ProcessAccessError as exc:
                self._matcher.next_scan()
                self._warn_unreadable([self.pid], 1, str(exc))
                return [], {}, True, False
            # objects named after another process are checked against it (read here)
            found = owners.Owners(self._matcher, [holdings], deadline=deadline)
            ignored: owners.Ignored = {}
            found.attribute(holdings, ignored)
            self._matcher.next_scan([holdings, *found.extra], more=found.paths)
            in_time = time.monotonic() <= deadline
            # an object mapped without an fd here: the pages its owner's fd measured
            pages = procgroup.measured_pages(found.extra)
            complete = scan.fill_residency(holdings, self._matcher, pages, smaps=in_time)
            complete = complete and holdings.complete
            totals = [procgroup.holdings_totals(holdings)]
            return totals, owners.ignored_counts(ignored), True, not complete
        result = procgroup.scan_totals(self._matcher, deadline=deadline)
        if result.unreadable and not self._warned_unreadable:
            first = result.unreadable_pids[0]
            try:
                why = procaccess.why_denied(first)
            except OSError:
                why = "it exited since"
            self._warn_unreadable(
                result.unreadable_pids,
                result.unreadable,
                f"pid {first}: {why} (`hostpool inspect PID` says what is missing for another)",
            )
        processes = [pools for _pid, pools in result.processes]
        return processes, result.ignored, True, result.truncated

    def _warn_unreadable(self, pids: list[int], count: int, detail: str) -> None:
        """Once: how many processes could not be read, their pids (the first few) and
        what this process lacks to read the first, in its own words (no advice to run as
        root to a process that is root)."""
        if not self._warned_unreadable:
            self._warned_unreadable = True
            events.warning(
                "hostpool.exporter_unreadable", processes=count, pids=pids, detail=detail
            )

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
            "Of the mapped bytes, those in memory: the pages each mapped object holds "
            "(st_blocks, at most the bytes mapped); smaps Rss where no fd tells them.",
            labels=LABELS,
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_mappings",
            "Mappings of matching shared-memory objects, summed over processes.",
            labels=LABELS,
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_pools_folded",
            'Pools beyond the per-prefix cap, summed into the pool="_other" series.',
            labels=["prefix"],
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_processes",
            "Processes holding a matching shared-memory fd or mapping that counts in its "
            "pool (--match only).",
            labels=["prefix"],
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_target_up",
            "1 while the --pid process exists, 0 before it started and once it exited "
            "(--pid only).",
            labels=["pid"],
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_scrape_duration_seconds",
            "Seconds this scrape spent reading /proc.",
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_scrape_truncated",
            "1 when this scrape reached its time budget (--scrape-budget) before reading "
            "every process: the other gauges are then partial sums.",
        )
        yield GaugeMetricFamily(
            "hostpool_exporter_ignored_objects",
            "Matching objects this scrape read and left out of every pool: named after "
            "another process that does not hold them (reason: owner_gone, "
            "not_held_by_owner, owner_other_uid, unverified).",
            labels=["prefix", "reason"],
        )
