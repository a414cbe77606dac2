#!/usr/bin/env python3
"""Build the hostpool Grafana dashboard with grafana-foundation-sdk.

`python dashboards/build.py` writes dashboards/hostpool.json; `--check` exits 1 when the
committed file differs from what this script generates (CI runs it through the tests).
The output is deterministic: sorted keys, stable uid, panel ids numbered in layout order.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import gauge, heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

UID = "hostpool-overview"
TITLE = "hostpool"
OUTPUT = Path(__file__).resolve().with_name("hostpool.json")

# Every panel and every query uses the datasource variable, never a fixed datasource.
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Label selectors. hostpool's and the process collector's metrics are filtered by the
# job/instance variables (and pool where the metric has one). node_exporter runs on its own
# port, so its instance never equals a hostpool target's: it has its own `node` variable.
TARGET = 'job=~"$job", instance=~"$instance"'
POOL = TARGET + ', pool=~"$pool"'
NODE = 'instance=~"$node"'
RATE = "[$__rate_interval]"

# Why a panel may legitimately be empty (the end-to-end test skips these when the named
# component is not scraped). The same note is appended to the panel's description.
NEEDS_NOTE = {
    "node_exporter": "Empty unless node_exporter is scraped (pick its host in `node`).",
    "exporter": "Empty unless `hostpool exporter` is scraped.",
    "node": "Empty unless `hostpool exporter --node` is scraped.",
    "vllm": "Empty unless a vLLM server with hostpool's integration is scraped, and until "
    "its metrics route has skipped a file.",
    "serve": "Empty unless `hostpool serve` is scraped (servers that embed hostpool, such as "
    "sglang and vLLM, have no populate phase of their own).",
}

PanelKind = Literal["timeseries", "heatmap", "stat", "gauge", "table"]
Needs = Literal["node_exporter", "exporter", "serve", "node", "vllm"]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    heatmap: bool = False
    table: bool = False  # an instant query, one row per series (a table panel's)


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: PanelKind = "timeseries"
    width: int = 8
    height: int = 8
    needs: Needs | None = None
    # (value, colour) steps; the first value is None (the base colour).
    thresholds: tuple[tuple[float | None, str], ...] = ((None, "green"),)
    max_value: float | None = None


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...]


def q(expr: str, legend: str) -> Query:
    return Query(expr=expr, legend=legend)


OVERVIEW = RowSpec(
    "Overview",
    (
        PanelSpec(
            "Allocated vs resident bytes",
            "Bytes mapped by live hostpool allocations and the part of them backed by memory "
            "now, per pool and backing page size. Resident should reach allocated once "
            "populate finishes. Resident well below allocated means populate was skipped "
            "(populate=none) or failed quietly: the server will page-fault on first touch, "
            "or SIGBUS when tmpfs runs out. Check the pool's populate mode (Hugepages and "
            "populate row) and `hostpool inspect PID`.",
            "bytes",
            (
                q(
                    f"sum by (pool, page_size) (hostpool_allocated_bytes{{{POOL}}})",
                    "{{pool}} {{page_size}} allocated",
                ),
                q(
                    f"sum by (pool, page_size) (hostpool_resident_bytes{{{POOL}}})",
                    "{{pool}} {{page_size}} resident",
                ),
            ),
            width=12,
        ),
        PanelSpec(
            "Resident share of allocated",
            "Resident / allocated bytes per pool. It should sit at 100% once populate "
            "finishes; below 50% for 30 minutes fires HostpoolResidentFarBelowAllocated. "
            "If it stays low, look at the populate modes panel and the server's "
            "hostpool.alloc events for the pool.",
            "percentunit",
            (
                q(
                    f"sum by (pool) (hostpool_resident_bytes{{{POOL}}})"
                    f" / (sum by (pool) (hostpool_allocated_bytes{{{POOL}}}) > 0)",
                    "{{pool}}",
                ),
            ),
            width=6,
            thresholds=((None, "red"), (0.5, "orange"), (0.99, "green")),
            max_value=1,
        ),
        PanelSpec(
            "Open fds per pool",
            "File descriptors the process holds for each pool: what /proc/PID/fd shows "
            "(a memfd plus mmap's internal dup, so two per live shm allocation). Growth "
            "without growth in live allocations means fds outlive their regions: compare "
            "with `hostpool inspect PID`. The process-wide limit is in the Process row.",
            "short",
            (q(f"sum by (pool) (hostpool_open_fds{{{POOL}}})", "{{pool}}"),),
            width=6,
        ),
        PanelSpec(
            "Live allocations",
            "Live allocations per pool and allocator. A count that keeps growing while the "
            "server's load is flat means the caller never closes what it allocates. A drop "
            "to zero while the process lives means the pool was closed.",
            "short",
            (
                q(
                    f"sum by (pool, allocator) (hostpool_live_allocations{{{POOL}}})",
                    "{{pool}} {{allocator}}",
                ),
            ),
        ),
        PanelSpec(
            "Released but still mapped",
            "Bytes of regions released explicitly while tensors or views still map them: "
            "the memory stays in use until the last view dies. A value that stays above "
            "zero or grows (HostpoolReleasedMappedGrowing) means some code keeps views of "
            "closed pools, or share peers stay attached: /debug/pools lists the regions "
            "(state released_mapped or released_shared).",
            "bytes",
            (q(f"sum by (pool) (hostpool_released_mapped_bytes{{{POOL}}})", "{{pool}}"),),
        ),
        PanelSpec(
            "Pinned bytes",
            "Bytes registered with CUDA (page-locked) per pool. It should equal the "
            "allocated bytes of pools configured with pin=True. Zero for such a pool means "
            "pinning failed (see the server's hostpool.pin events): host-to-device copies "
            "then go through a staging buffer and are slower.",
            "bytes",
            (q(f"sum by (pool) (hostpool_pinned_bytes{{{POOL}}})", "{{pool}}"),),
        ),
    ),
)

LIFECYCLE = RowSpec(
    "Lifecycle",
    (
        PanelSpec(
            "Allocation rate",
            "Allocations per second per pool and allocator. Expect bursts at startup only. "
            "A steady rate after warm-up means pools are re-created over and over (churn); "
            "each allocation maps and populates memory, which is slow: keep pools for the "
            "life of the server.",
            "ops",
            (
                q(
                    f"sum by (pool, allocator) (rate(hostpool_allocations_total{{{POOL}}}{RATE}))",
                    "{{pool}} {{allocator}}",
                ),
            ),
            width=12,
        ),
        PanelSpec(
            "Release rate by how",
            "Releases per second, by how: explicit (close(), release(), mm.close(), a "
            "server's teardown), tensor (a region handed to its tensor, as alloc_shm and "
            "alloc_mmap do, ended with it: normal) or finalizer (an owner that should have "
            "released it was collected first). Finalizer releases should be zero: see the "
            "leak signal panel.",
            "ops",
            (
                q(
                    f"sum by (pool, how) (rate(hostpool_releases_total{{{POOL}}}{RATE}))",
                    "{{pool}} {{how}}",
                ),
            ),
            width=12,
        ),
        PanelSpec(
            "Allocation failures by reason",
            "Allocations refused or failed in each interval, by reason: budget (over the "
            "budget), hugepages (hugepages=required, none free), no_memory, no_space "
            "(tmpfs or /dev/shm full), fd_limit (RLIMIT_NOFILE), invalid (a bad request: a "
            "caller bug), other. Any failure fires HostpoolAllocationFailures; the runbook "
            "has the remedy for each reason.",
            "short",
            (
                q(
                    "sum by (pool, reason) "
                    f"(increase(hostpool_allocation_failures_total{{{POOL}}}{RATE}))",
                    "{{pool}} {{reason}}",
                ),
            ),
            thresholds=((None, "green"), (1, "red")),
            width=12,
        ),
        PanelSpec(
            "Finalizer releases (leak signal)",
            "Regions released in each interval because the owner that should have released "
            "them (a HostPoolManager, a retain=True allocator, a server's host pool) was "
            "collected without close()/destroy(). Tensors that own their region (alloc_shm, "
            "alloc_mmap, plain allocators) never count here. The memory came back later "
            "than intended, which shows as memory spikes under load. Any value above zero "
            "fires HostpoolFinalizerReleases: make the owner close, and catch it in tests "
            "with hostpool.testing.",
            "short",
            (
                q(
                    "sum by (pool) (increase(hostpool_releases_total"
                    f'{{{POOL}, how="finalizer"}}{RATE}))',
                    "{{pool}}",
                ),
            ),
            thresholds=((None, "green"), (1, "red")),
            width=12,
        ),
        PanelSpec(
            "fds closed by a caller",
            "Releases that found the region's fd number naming another file: the code "
            "using the pool closed hostpool's fd (handed out by .fd/.fds) and the kernel "
            "reused the number. hostpool left that file open; the pool's owner must not "
            "close fds it did not dup.",
            "short",
            (
                q(
                    f"sum by (pool) (increase(hostpool_fd_reuse_skips_total{{{POOL}}}{RATE}))",
                    "{{pool}}",
                ),
            ),
            thresholds=((None, "green"), (1, "red")),
            width=12,
        ),
    ),
)

HUGEPAGES = RowSpec(
    "Hugepages and populate",
    (
        PanelSpec(
            "Hugepage fallbacks by reason",
            "Allocations that asked for hugepages (hugepages=prefer) and got smaller pages, "
            "per interval and reason: hugetlb_pool_short (reserve more pages of that size), "
            "hugetlb_unsupported (no pool of that size on this host), thp_disabled "
            "(shmem_enabled forbids transparent hugepages), devshm_no_hugepages (memfd "
            "unavailable, the /dev/shm fallback cannot use hugetlb). Populate and teardown "
            "are much slower on 4 KiB pages; see `hostpool doctor`.",
            "short",
            (
                q(
                    "sum by (pool, reason) "
                    f"(increase(hostpool_hugepage_fallbacks_total{{{POOL}}}{RATE}))",
                    "{{pool}} {{reason}}",
                ),
            ),
            thresholds=((None, "green"), (1, "orange")),
        ),
        PanelSpec(
            "Allocated bytes by page size",
            "Where the selected pools' memory lives, by backing page size. With hugepages "
            "configured, bytes on 4KiB mean allocations fell back: see the fallbacks panel.",
            "bytes",
            (q(f"sum by (page_size) (hostpool_allocated_bytes{{{POOL}}})", "{{page_size}}"),),
        ),
        PanelSpec(
            "Populate modes",
            "Live allocations per populate mode. madvise (MADV_POPULATE_WRITE) is expected "
            "on kernels 5.14 and newer; map_populate or touch mean an older kernel; none "
            "means populate=none was configured, and resident bytes lag allocated bytes "
            "until first touch.",
            "short",
            (
                q(
                    f"sum by (pool, mode) (hostpool_populate_mode{{{POOL}}})",
                    "{{pool}} {{mode}}",
                ),
            ),
        ),
        PanelSpec(
            "Free hugepages per size",
            "Free minus reserved hugetlb pages per page size, as hostpool sees them on each "
            "target's host. Near zero means the next hugepage allocation falls back "
            "(hugepages=prefer) or fails (hugepages=required): reserve more pages of that "
            "size (/sys/kernel/mm/hugepages/hugepages-<size>/nr_hugepages).",
            "short",
            (
                q(
                    f"sum by (instance, page_size) (hostpool_hugepages_free{{{TARGET}}})",
                    "{{instance}} {{page_size}}",
                ),
            ),
            width=24,
        ),
        PanelSpec(
            "Populate progress (hostpool serve)",
            "Share of each pool's bytes that `hostpool serve` has populated so far "
            "(hostpool_serve_populate_done_bytes / hostpool_serve_populate_target_bytes). "
            "It climbs to 100% during start-up, while /healthz already answers and /readyz "
            "says what is left; a line stuck below 100% is a populate that stalled (memory "
            "pressure, reclaim) or a start that failed: see the server's log.",
            "percentunit",
            (
                q(
                    f"sum by (pool) (hostpool_serve_populate_done_bytes{{{POOL}}}) / "
                    f"sum by (pool) (hostpool_serve_populate_target_bytes{{{POOL}}})",
                    "{{pool}}",
                ),
            ),
            width=12,
            max_value=1,
            needs="serve",
        ),
        PanelSpec(
            "Ready (hostpool serve)",
            "1 once every pool of `hostpool serve` is populated and it serves (its /readyz "
            "answers 200), 0 while it populates or stops.",
            "short",
            (q(f"min by (instance) (hostpool_serve_ready{{{TARGET}}})", "{{instance}}"),),
            kind="stat",
            width=12,
            thresholds=((None, "red"), (1, "green")),
            needs="serve",
        ),
        PanelSpec(
            "Broker leases (hostpool serve)",
            "Parts of each pool (memory, index) that `hostpool serve`, as the broker, lends "
            "to an engine now (hostpool_broker_leases). A lease ends when the engine closes "
            "its connection or dies; the pool and its contents stay with the broker.",
            "short",
            (q(f"sum by (pool) (hostpool_broker_leases{{{POOL}}})", "{{pool}}"),),
            width=12,
            needs="serve",
        ),
        PanelSpec(
            "Broker index records adopted and discarded",
            "Offload index records a restarted engine adopted (blocks it found in the "
            "broker's pool: hostpool_broker_adopted_blocks_total) and those it discarded "
            "(hostpool_broker_discarded_blocks_total by reason: identity, unfinished, torn, "
            "random_seed, resized). Discards by identity after a deploy mean the engine's "
            "model or layout changed: expected once per change.",
            "short",
            (
                q(
                    f"sum by (pool) (increase(hostpool_broker_adopted_blocks_total{{{POOL}}}"
                    f"{RATE}))",
                    "{{pool}} adopted",
                ),
                q(
                    "sum by (pool, reason) (increase("
                    f"hostpool_broker_discarded_blocks_total{{{POOL}}}{RATE}))",
                    "{{pool}} discarded {{reason}}",
                ),
            ),
            width=12,
            needs="serve",
        ),
    ),
)


def _quantile(phi: str) -> Query:
    return q(
        f"histogram_quantile({phi}, sum by (pool, le) "
        f"(rate(hostpool_allocation_duration_seconds_bucket{{{POOL}}}{RATE})))",
        f"{{{{pool}}}} p{phi[2:].ljust(2, '0')}",
    )


LATENCY = RowSpec(
    "Latency",
    (
        PanelSpec(
            "Allocation duration quantiles",
            "Time to allocate and populate one region: p50, p90, p99 and mean per pool. "
            "Populate dominates and scales with size; hugepages make it several times "
            "faster. A jump without a change in allocation sizes points at memory pressure "
            "(reclaim during populate) or at allocations falling back from hugepages.",
            "s",
            (
                _quantile("0.5"),
                _quantile("0.9"),
                _quantile("0.99"),
                q(
                    "sum by (pool) "
                    f"(rate(hostpool_allocation_duration_seconds_sum{{{POOL}}}{RATE}))"
                    " / sum by (pool) "
                    f"(rate(hostpool_allocation_duration_seconds_count{{{POOL}}}{RATE}))",
                    "{{pool}} mean",
                ),
            ),
            width=12,
        ),
        PanelSpec(
            "Allocation duration heatmap",
            "Allocations per duration bucket and interval, selected pools together. A "
            "second band at higher durations means some allocations became slower: "
            "usually those that fell back from hugepages or ran into reclaim.",
            "short",
            (
                Query(
                    "sum by (le) (increase("
                    f"hostpool_allocation_duration_seconds_bucket{{{POOL}}}{RATE}))",
                    "{{le}}",
                    heatmap=True,
                ),
            ),
            kind="heatmap",
            width=12,
        ),
    ),
)

BUDGET = RowSpec(
    "Budget",
    (
        PanelSpec(
            "Budget and reservations",
            "One line per limit that applies (configured budget, MemAvailable minus "
            "headroom, cgroup room, host-wide budget, hugetlb pool): the bytes reserved "
            "plus the room that limit leaves now, never above what the host or cgroup "
            "holds. The lowest normal-page line is the limit that binds; hugetlb binds "
            "hugetlb-backed requests only. Reserved is what hostpool holds plus what is "
            "being allocated.",
            "bytes",
            (
                q(f"hostpool_budget_bytes{{{TARGET}}}", "{{instance}} {{limit}}"),
                q(f"hostpool_budget_reserved_bytes{{{TARGET}}}", "{{instance}} reserved"),
            ),
            width=16,
        ),
        PanelSpec(
            "Budget used",
            "Reserved / the binding limit per target (the highest share over the "
            "normal-page limits). Above 90% for 15 minutes fires HostpoolBudgetNearlyUsed, "
            "naming the limit: the next large allocation will be refused. Raise the "
            "budget, shrink pools, or free host memory.",
            "percentunit",
            (
                q(
                    "max without (limit) ("
                    f"hostpool_budget_reserved_bytes{{{TARGET}}}"
                    " / ignoring (limit) group_right ()"
                    f' (hostpool_budget_bytes{{{TARGET}, limit!="hugetlb"}} > 0))',
                    "{{instance}}",
                ),
            ),
            kind="gauge",
            thresholds=((None, "green"), (0.8, "orange"), (0.9, "red")),
            max_value=1,
        ),
    ),
)


SHARING = RowSpec(
    "Sharing",
    (
        PanelSpec(
            "Attached clients",
            "Peer processes holding a pool's fds through `share`. Fewer than expected means "
            "a peer cannot read the cache: check its logs and the share socket's path and "
            "permissions. Clients that stay attached after they should have gone keep the "
            "pool's memory mapped after the server releases it.",
            "short",
            (q(f"sum by (pool) (hostpool_attached_clients{{{POOL}}})", "{{pool}}"),),
            width=24,
        ),
    ),
)

PROCESS = RowSpec(
    "Process and host context",
    (
        PanelSpec(
            "Process open fds vs limit",
            "Open file descriptors of the whole process against its RLIMIT_NOFILE. "
            "hostpool uses two per live shm allocation. Above 80% of the limit "
            "HostpoolOpenFdsNearLimit fires, and at the limit allocations fail with "
            "reason=fd_limit: raise the limit (ulimit -n, LimitNOFILE=) or use fewer, larger "
            "allocations.",
            "short",
            (
                q(f"process_open_fds{{{TARGET}}}", "{{instance}} open"),
                q(f"process_max_fds{{{TARGET}}}", "{{instance}} limit"),
            ),
        ),
        PanelSpec(
            "Process resident memory vs hostpool resident",
            "The process's RSS next to the resident bytes of the selected hostpool pools. "
            "RSS counts shared pages only once the process touched them, so a pool "
            "resident but absent from RSS is populated and not yet used. RSS far above "
            "hostpool's share is memory outside hostpool.",
            "bytes",
            (
                q(f"process_resident_memory_bytes{{{TARGET}}}", "{{instance}} process RSS"),
                q(
                    f"sum by (instance) (hostpool_resident_bytes{{{POOL}}})",
                    "{{instance}} hostpool resident",
                ),
            ),
        ),
        PanelSpec(
            "Multiprocess publish errors",
            "Failed publishes of hostpool's series into prometheus_client's multiprocess "
            "directory (sglang, vLLM workers), by kind: fd_limit, no_space, permission, "
            "os_error, other. While they fail, that worker's hostpool series are stale; the "
            "publisher retries every interval and the first success shows the count. Any "
            "value above zero fires HostpoolPublishErrors.",
            "short",
            (
                q(
                    "sum by (instance, kind) "
                    f"(increase(hostpool_publish_errors_total{{{TARGET}}}{RATE}))",
                    "{{instance}} {{kind}}",
                ),
            ),
            thresholds=((None, "green"), (1, "red")),
        ),
        PanelSpec(
            "vLLM metrics route: skipped files",
            "Files in vLLM's metrics directory that hostpool's metrics route left out of "
            "/metrics, per interval and reason: name (not a worker's pid), not_regular (a "
            "FIFO, symlink or directory), owner (another uid's), too_large, malformed, "
            "stale_pid (left by an earlier process with that pid). Each scrape counts a file "
            "again while it is there: a steady rate is one file to remove (the server logs "
            "hostpool.vllm_metrics_file_skipped once per reason, with its name).",
            "short",
            (
                q(
                    "sum by (instance, reason) "
                    f"(increase(hostpool_vllm_route_skipped_files_total{{{TARGET}}}{RATE}))",
                    "{{instance}} {{reason}}",
                ),
            ),
            thresholds=((None, "green"), (1, "orange")),
            needs="vllm",
        ),
        PanelSpec(
            "Collector scrape time",
            "Time hostpool's collector took to build the last scrape. Above a second means "
            "very many live regions: scrapes risk timing out (raise scrape_timeout) and "
            "fewer, larger allocations would help.",
            "s",
            (q(f"hostpool_scrape_duration_seconds{{{TARGET}}}", "{{instance}}"),),
        ),
        PanelSpec(
            "hostpool versions",
            "Targets per hostpool version. More than one version is expected only during a "
            "rollout; an unexpected one is a server that was not restarted.",
            "short",
            (q(f"count by (version) (hostpool_build_info{{{TARGET}}})", "{{version}}"),),
            kind="stat",
        ),
        PanelSpec(
            "Host Shmem (node_exporter)",
            "Shmem on the host (node_exporter): tmpfs, /dev/shm and memfds, hostpool's "
            "pools included, hugetlb pages excluded. Far above hostpool's allocated bytes "
            "means other processes or leftover /dev/shm files hold shared memory: the Host "
            "shared memory row (`hostpool exporter --node`) and `hostpool shm` say whose.",
            "bytes",
            (q(f"node_memory_Shmem_bytes{{{NODE}}}", "{{instance}}"),),
            needs="node_exporter",
        ),
        PanelSpec(
            "Host free hugepages (default size)",
            "Free hugepages of the kernel's default hugepage size (node_exporter shows only "
            "that size; hostpool's Free hugepages per size panel shows every size). Zero "
            "means hugepage allocations of that size fall back or fail.",
            "short",
            (q(f"node_memory_HugePages_Free{{{NODE}}}", "{{instance}}"),),
            needs="node_exporter",
        ),
    ),
)

EXPORTER = RowSpec(
    "Exporter (other processes)",
    (
        PanelSpec(
            "Exporter: mapped vs resident bytes",
            "Bytes that processes matched by `hostpool exporter` map for each pool (read "
            "from /proc), and how much of it is resident. Resident far below mapped means "
            "the server did not populate its pools.",
            "bytes",
            (
                q(
                    f"sum by (prefix, pool) (hostpool_exporter_mapped_bytes{{{POOL}}})",
                    "{{prefix}} {{pool}} mapped",
                ),
                q(
                    f"sum by (prefix, pool) (hostpool_exporter_resident_bytes{{{POOL}}})",
                    "{{prefix}} {{pool}} resident",
                ),
            ),
            needs="exporter",
        ),
        PanelSpec(
            "Exporter: open fds",
            "File descriptors the matched processes hold for each pool. Growth without "
            "growth in mapped bytes means the server leaks fds (closed mappings, open fds).",
            "short",
            (
                q(
                    f"sum by (prefix, pool) (hostpool_exporter_open_fds{{{POOL}}})",
                    "{{prefix}} {{pool}}",
                ),
            ),
            needs="exporter",
        ),
        PanelSpec(
            "Exporter: mappings",
            "Mappings of each pool in the matched processes. Far more mappings than fds "
            "means the server maps the same memory repeatedly without unmapping.",
            "short",
            (
                q(
                    f"sum by (prefix, pool) (hostpool_exporter_mappings{{{POOL}}})",
                    "{{prefix}} {{pool}}",
                ),
            ),
            needs="exporter",
        ),
        PanelSpec(
            "Exporter: matched processes, folded pools",
            "Processes the exporter matched per prefix (`--match`). Zero means the watched "
            "server is down or names its memory with another prefix (hostpool. or "
            "sglang_host_pool_): check `hostpool exporter --match`. With `--pid`: 1 while "
            "the watched process exists, 0 once it exited. Folded: pools past the "
            'exporter\'s --max-pools, summed into pool="_other" (someone names many memfds '
            "after the prefix). Truncated: 1 while scrapes reach the exporter's "
            "--scrape-budget before reading every process (its sums are then partial). "
            "Ignored: objects named after a process that does not hold them, in no pool "
            "(by reason: a forged name, its owner gone or unreadable).",
            "short",
            (
                q(f"sum by (prefix) (hostpool_exporter_processes{{{TARGET}}})", "{{prefix}}"),
                q(f"max by (pid) (hostpool_exporter_target_up{{{TARGET}}})", "pid {{pid}}"),
                q(
                    f"sum by (prefix) (hostpool_exporter_pools_folded{{{TARGET}}})",
                    "{{prefix}} folded pools",
                ),
                q(
                    f"max by (instance) (hostpool_exporter_scrape_truncated{{{TARGET}}})",
                    "{{instance}} truncated",
                ),
                q(
                    f"sum by (prefix, reason) (hostpool_exporter_ignored_objects{{{TARGET}}})",
                    "{{prefix}} ignored {{reason}}",
                ),
            ),
            width=24,
            needs="exporter",
        ),
        PanelSpec(
            "Exporter scrape time",
            "Time `hostpool exporter` spent reading /proc for the last scrape (--pid or "
            "--match). Near its --scrape-budget the scrape is cut short and its sums are "
            "partial (truncated, in the panel above): narrow --match, or raise the budget "
            "below Prometheus' scrape_timeout.",
            "s",
            (
                q(
                    f"max by (instance) (hostpool_exporter_scrape_duration_seconds{{{TARGET}}})",
                    "{{instance}}",
                ),
            ),
            width=12,
            needs="exporter",
        ),
        PanelSpec(
            "Exporter scans",
            "Scans per second `hostpool exporter` ran (`hostpool_exporter_scans_total`; --pid, "
            "--match and --node alike): one scan "
            "answers every scrape for --min-scan-interval (1 s by default), so a flood of "
            "/metrics requests does not raise it above 1/interval; more scrapers or a "
            "shorter scrape interval than expected show here.",
            "ops",
            (
                q(
                    "sum by (instance) "
                    f"(rate(hostpool_exporter_scans_total{{{TARGET}}}[$__rate_interval]))",
                    "{{instance}}",
                ),
            ),
            width=12,
            needs="exporter",
        ),
    ),
)


def named_pods(expr: str, by: str) -> str:
    """`expr` (summed `by` labels that include pod_uid) with each pod's `namespace` and
    `pod` from kube-state-metrics' kube_pod_info, joined on its uid; series of no pod, or
    of pods it does not list, kept as they are (the rule
    instance_pod_engine_area_state:hostpool_host_shm_bytes:sum, for any grouping)."""
    pods = (
        "group by (pod_uid, namespace, pod) "
        '(label_join(kube_pod_info{uid!=""}, "pod_uid", "", "uid"))'
    )
    return f"({expr}) * on (pod_uid) group_left (namespace, pod) {pods} or on ({by}) ({expr})"


_POD_SHM = f'sum by (pod_uid) (hostpool_host_shm_bytes{{{TARGET}, pod_uid!=""}})'
_POD_ORPHANS = (
    "sum by (instance, pod_uid, engine, area) "
    f'(hostpool_host_shm_bytes{{{TARGET}, state="orphaned"}})'
)

# `hostpool exporter --node`: every shared-memory object on the host, by the fixed label
# sets (engine, kind, state, area) and pod uid; never a pid, path or name.
HOST_SHM = RowSpec(
    "Host shared memory",
    (
        PanelSpec(
            "Host shm by engine and state",
            "Resident bytes of every shared-memory object on the host (memfds, tmpfs files "
            "in every mount namespace, SysV segments, anonymous shared mappings), by the "
            "engine its name belongs to and whether a process holds it (held) or none does "
            "(orphaned: it stays in RAM until unlinked). Hugetlb objects are in their own "
            "panel. `hostpool shm` lists the objects, with their holders.",
            "bytes",
            (
                q(
                    f"sum by (engine, state) (hostpool_host_shm_bytes{{{TARGET}}})",
                    "{{engine}} {{state}}",
                ),
            ),
            width=12,
            needs="node",
        ),
        PanelSpec(
            "Host Shmem: attributed and unattributed",
            "The host's Shmem (/proc/meminfo), the part of it the objects found hold "
            "(attributed), and the rest (unattributed): processes the exporter may not read, "
            "tmpfs it cannot reach, or kernel users of shmem. Unattributed above 10% of "
            "Shmem and 1 GiB for 15 minutes fires HostpoolShmemUnattributed.",
            "bytes",
            (
                q(
                    f"sum by (instance) (hostpool_host_shmem_bytes{{{TARGET}}})",
                    "{{instance}} Shmem",
                ),
                q(
                    f"sum by (instance) (hostpool_host_shm_bytes{{{TARGET}}})",
                    "{{instance}} attributed",
                ),
                q(
                    f"sum by (instance) (hostpool_host_shmem_unattributed_bytes{{{TARGET}}})",
                    "{{instance}} unattributed",
                ),
            ),
            width=12,
            needs="node",
        ),
        PanelSpec(
            "Orphaned shared memory",
            "Resident bytes of objects no process holds (tmpfs files, unattached SysV "
            "segments), by engine and kind: what an engine that exited uncleanly (SIGKILL, "
            "OOM kill, container restart) left behind. Empty while there are none. Above "
            "zero for 10 minutes fires HostpoolOrphanedShm: `hostpool shm --orphans` lists "
            "them, `hostpool reap` frees them.",
            "bytes",
            (
                q(
                    "sum by (instance, engine, kind) "
                    f'(hostpool_host_shm_bytes{{{TARGET}, state="orphaned"}})',
                    "{{instance}} {{engine}} {{kind}}",
                ),
                q(
                    "sum by (instance, engine, kind) "
                    f'(hostpool_host_hugetlb_bytes{{{TARGET}, state="orphaned"}})',
                    "{{instance}} {{engine}} {{kind}} hugetlb",
                ),
            ),
            thresholds=((None, "green"), (1, "red")),
            needs="node",
        ),
        PanelSpec(
            "Oldest orphan age",
            "Per engine, seconds since its oldest orphan last changed. Empty while there are "
            "no orphans. Old orphans are left by a crash, not by a restart under way: "
            "`hostpool reap` (default --min-age 10m) frees those.",
            "s",
            (
                q(
                    "max by (instance, engine) "
                    f"(hostpool_host_shm_oldest_orphan_age_seconds{{{TARGET}}})",
                    "{{instance}} {{engine}}",
                ),
            ),
            thresholds=((None, "green"), (600, "orange")),
            needs="node",
        ),
        PanelSpec(
            "Top pods by shared memory",
            "The 10 pods whose shared memory holds the most RAM (resident bytes of the "
            "objects their processes hold, of their kubelet volumes and of their own "
            "/dev/shm; hugetlb left out), named by kube-state-metrics' kube_pod_info where "
            "it is scraped (else by uid). An object held by processes of several pods "
            "belongs to none and is not here. `hostpool shm --by pod` lists the objects.",
            "bytes",
            (
                q(
                    f"topk(10, {named_pods(_POD_SHM, 'pod_uid')})",
                    "{{namespace}}/{{pod}} {{pod_uid}}",
                ),
            ),
            width=12,
            needs="node",
        ),
        PanelSpec(
            "Orphans by pod",
            "Orphaned shared memory now (files no process holds, unattached SysV segments; "
            "hugetlb left out) by node, pod, engine and area: the pod's name where "
            "kube-state-metrics is scraped, no pod for the node's own (/dev/shm of the "
            "host, SysV). `unknown` orphans are listed here and never paged "
            "(HostpoolOrphanedShm is for known engines): `hostpool reap` takes them only "
            "when told (`--engine unknown`), and nothing says whose they are.",
            "bytes",
            (Query(named_pods(_POD_ORPHANS, "instance, pod_uid, engine, area"), "", table=True),),
            kind="table",
            width=12,
            needs="node",
        ),
        PanelSpec(
            "Host shm objects by engine and kind",
            "Shared-memory objects on the host by engine, kind and state (one per inode: a "
            "file seen in two mount namespaces, or held by ten processes, counts once). A "
            "count that keeps growing under a flat load is an engine that makes objects and "
            "never frees them.",
            "short",
            (
                q(
                    f"sum by (engine, kind, state) (hostpool_host_shm_objects{{{TARGET}}})",
                    "{{engine}} {{kind}} {{state}}",
                ),
            ),
            needs="node",
        ),
        PanelSpec(
            "Host hugetlb objects",
            "Resident bytes of shared-memory objects backed by hugetlb pages, by engine, "
            "kind and state. They are not part of Shmem (hence not in the panels above); "
            "hugetlb pages held by an orphan are lost to every other process until it is "
            "freed.",
            "bytes",
            (
                q(
                    f"sum by (engine, kind, state) (hostpool_host_hugetlb_bytes{{{TARGET}}})",
                    "{{engine}} {{kind}} {{state}}",
                ),
            ),
            width=12,
            needs="node",
        ),
        PanelSpec(
            "Node view scrape time",
            "Time `hostpool exporter --node` spent reading the host view (every process's "
            "fds and maps, every tmpfs, SysV) for the last scrape. Near the exporter's "
            "--scrape-budget the scrape is cut short: see the truncated panel.",
            "s",
            (
                q(
                    f"max by (instance) (hostpool_host_scrape_duration_seconds{{{TARGET}}})",
                    "{{instance}}",
                ),
            ),
            width=6,
            needs="node",
        ),
        PanelSpec(
            "Node view truncated, unreadable",
            "Truncated: 1 while the host view's reading reaches the exporter's "
            "--scrape-budget before reading everything (the panels of this row are then "
            "partial, unattributed bytes too high): raise --scrape-budget, below "
            "Prometheus' scrape_timeout; 'ran out in' names the phase of the reading where "
            "the budget ran out (mountinfo, processes, tmpfs, sysv). Unreadable: processes "
            "the exporter may not read; what only they hold shows as orphaned or "
            "unattributed: give it CAP_SYS_PTRACE and the host's PID namespace.",
            "short",
            (
                q(
                    f"max by (instance) (hostpool_host_scrape_truncated{{{TARGET}}})",
                    "{{instance}} truncated",
                ),
                q(
                    "max by (instance, phase) "
                    f"(hostpool_host_scrape_truncated_phase{{{TARGET}}}) == 1",
                    "{{instance}} ran out in {{phase}}",
                ),
                q(
                    f"max by (instance) (hostpool_host_unreadable_processes{{{TARGET}}})",
                    "{{instance}} unreadable",
                ),
            ),
            kind="stat",
            width=6,
            thresholds=((None, "green"), (1, "red")),
            needs="node",
        ),
    ),
)

ROWS: tuple[RowSpec, ...] = (
    OVERVIEW,
    LIFECYCLE,
    HUGEPAGES,
    LATENCY,
    BUDGET,
    SHARING,
    PROCESS,
    EXPORTER,
    HOST_SHM,
)

# Panels allowed to be empty, by what they need (for the end-to-end test).
OPTIONAL_PANELS: dict[str, Needs] = {
    panel.title: panel.needs for row in ROWS for panel in row.panels if panel.needs is not None
}
NODE_EXPORTER_PANELS = frozenset(t for t, n in OPTIONAL_PANELS.items() if n == "node_exporter")
EXPORTER_PANELS = frozenset(t for t, n in OPTIONAL_PANELS.items() if n == "exporter")
NODE_VIEW_PANELS = frozenset(t for t, n in OPTIONAL_PANELS.items() if n == "node")


def _description(panel: PanelSpec) -> str:
    if panel.needs is None:
        return panel.description
    return f"{panel.description} {NEEDS_NOTE[panel.needs]}"


def _target(query: Query, ref_id: str) -> prometheus.Dataquery:
    target = (
        prometheus.Dataquery()
        .expr(query.expr)
        .legend_format(query.legend)
        .ref_id(ref_id)
        .datasource(DATASOURCE)
        .range()
    )
    if query.heatmap:
        target = target.format(PromQueryFormat.HEATMAP)
    if query.table:
        target = target.instant().format(PromQueryFormat.TABLE)
    return target


def _thresholds(steps: tuple[tuple[float | None, str], ...]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=color) for value, color in steps])
    )


# A table panel's columns: the labels that say where, the value last; no time column.
_TABLE_COLUMNS = DataTransformerConfig(
    id_val="organize",
    options={
        "excludeByName": {"Time": True},
        "indexByName": {
            "instance": 0,
            "namespace": 1,
            "pod": 2,
            "pod_uid": 3,
            "engine": 4,
            "area": 5,
            "Value": 6,
        },
        "renameByName": {"Value": "resident bytes"},
    },
)


def _last_value() -> common_builders.ReduceDataOptions:
    return common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False)


def _panel(spec: PanelSpec, panel_id: int) -> Any:
    builder: Any
    if spec.kind == "timeseries":
        builder = (
            timeseries.Panel()
            .fill_opacity(10)
            .show_points(common.VisibilityMode.NEVER)
            .legend(
                common_builders.VizLegendOptions()
                .show_legend(True)
                .display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.BOTTOM)
                .calcs(["lastNotNull", "max"])
            )
            .tooltip(
                common_builders.VizTooltipOptions()
                .mode(common.TooltipDisplayMode.MULTI)
                .sort(common.SortOrder.DESCENDING)
            )
            .min(0)
        )
    elif spec.kind == "heatmap":
        builder = (
            heatmap.Panel()
            .calculate(False)
            .y_axis(heatmap.YAxisConfig().unit("s"))
            .cell_values(heatmap.CellValues().unit(spec.unit))
            .color(
                heatmap.HeatmapColorOptions()
                .mode(heatmap_models.HeatmapColorMode.SCHEME)
                .scheme("Oranges")
                .fill("dark-orange")
                .steps(64)
                .scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
                .exponent(0.5)
            )
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        )
    elif spec.kind == "stat":
        builder = (
            stat.Panel()
            .graph_mode(common.BigValueGraphMode.NONE)
            .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
            .reduce_options(_last_value())
        )
    elif spec.kind == "table":
        builder = table.Panel().show_header(True).with_transformation(_TABLE_COLUMNS)
    else:
        builder = gauge.Panel().min(0).reduce_options(_last_value())
    builder = (
        builder.id(panel_id)
        .title(spec.title)
        .description(_description(spec))
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .span(spec.width)
        .height(spec.height)
        .thresholds(_thresholds(spec.thresholds))
    )
    if spec.max_value is not None:
        builder = builder.max(spec.max_value)
    ref_ids = "ABCDEFGHIJ"
    for ref_id, query in zip(ref_ids, spec.queries, strict=False):
        builder = builder.with_target(_target(query, ref_id))
    return builder


def _query_variable(name: str, label: str, query: str, description: str) -> dash.QueryVariable:
    return (
        dash.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


# one metric every server and exporter exports: an exporter exports
# hostpool_exporter_processes with --match, hostpool_exporter_target_up with --pid,
# hostpool_host_shmem_bytes with --node
_TARGET_METRICS = (
    "hostpool_build_info|hostpool_exporter_processes|hostpool_exporter_target_up"
    "|hostpool_host_shmem_bytes"
)


def variables() -> list[Any]:
    return [
        dash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        _query_variable(
            "job",
            "Job",
            f'label_values({{__name__=~"{_TARGET_METRICS}"}}, job)',
            "Scrape jobs exposing hostpool metrics (servers and exporters).",
        ),
        _query_variable(
            "instance",
            "Instance",
            f'label_values({{__name__=~"{_TARGET_METRICS}", job=~"$job"}}, instance)',
            "Targets of the selected jobs.",
        ),
        _query_variable(
            "pool",
            "Pool",
            'label_values({__name__=~"hostpool_open_fds|hostpool_exporter_open_fds",'
            ' job=~"$job", instance=~"$instance"}, pool)',
            "hostpool pools of the selected targets.",
        ),
        _query_variable(
            "node",
            "Host (node_exporter)",
            "label_values(node_memory_Shmem_bytes, instance)",
            "node_exporter targets for the host context panels.",
        ),
    ]


def build() -> Any:
    """The dashboard model (grafana_foundation_sdk.models.dashboard.Dashboard)."""
    builder = (
        dash.Dashboard(TITLE)
        .uid(UID)
        .description(
            "hostpool's shared-memory host pools: memory, lifecycle, hugepages, latency, "
            "budget, sharing. Every panel's description says what to do when it looks wrong."
        )
        .tags(["hostpool"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .timezone("browser")
        .refresh("30s")
        .variables(variables())
    )
    panel_id = 0
    for row in ROWS:
        panel_id += 1
        builder = builder.with_row(dash.Row(row.title).id(panel_id))
        for spec in row.panels:
            panel_id += 1
            builder = builder.with_panel(_panel(spec, panel_id))
    return builder.build()


def render() -> str:
    model = json.loads(json.dumps(build(), cls=JSONEncoder))
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help="default: %(default)s")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if the output file differs from what would be generated",
    )
    args = parser.parse_args(argv)
    text = render()
    output: Path = args.output
    if args.check:
        current = output.read_text(encoding="utf-8") if output.exists() else None
        if current != text:
            print(
                f"{output} is out of date: run `python dashboards/build.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
