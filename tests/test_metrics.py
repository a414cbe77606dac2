"""The collector against independent measurements: /proc/self/fd, fstat, smaps, mincore."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from prometheus_client import CollectorRegistry

from hostpool import HostPoolManager
from hostpool.metrics import HostPoolCollector, register_metrics
from tests import dashboard_lint as lint
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _samples(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _value(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    matches = [
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    ]
    assert matches, f"no {name}{labels}"
    return sum(matches)


def _smaps_rss(name: str) -> tuple[int, int]:
    """Rss and *_Hugetlb of the mappings whose line names `name`, from /proc/self/smaps."""
    rss = huge = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                inside = name in line
            elif inside and first == "Rss:":
                rss += int(line.split()[1]) * 1024
            elif inside and first in ("Shared_Hugetlb:", "Private_Hugetlb:"):
                huge += int(line.split()[1]) * 1024
    return rss, huge


def test_what_a_registry_exposes_is_the_documented_catalogue() -> None:
    """Names, types and labels as a scrape sees them, against metrics/README.md's tables
    (read independently of the library): every documented series and nothing else."""
    registry = CollectorRegistry()
    register_metrics(registry)
    assert register_metrics(registry) is register_metrics(registry)  # idempotent
    catalogue = {
        name: metric
        for name, metric in lint.load_catalogue().items()
        # not this collector's
        if not name.startswith(
            (
                "hostpool_exporter_",
                "hostpool_host_",
                "hostpool_serve_",
                "hostpool_vllm_",
                "hostpool_broker_",
            )
        )
    }
    with HostPoolManager() as m:
        t = m.allocator("typed").allocate((4096,), torch.uint8)
        families = list(registry.collect())
        del t
    # prometheus_client names a counter family without the `_total` its samples carry
    exposed = {f.name + ("_total" if f.type == "counter" else ""): f for f in families}
    assert set(exposed) == set(catalogue)
    labelled = 0
    for name, family in exposed.items():
        assert family.type == catalogue[name].type, name
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            assert set(sample.labels) - {"le"} == set(catalogue[name].labels), sample
            labelled += 1
    assert labelled >= len(exposed) - 3  # pinned, fallbacks and failures may have none yet
    assert {f.name for f in HostPoolCollector().describe()} == {f.name for f in families}


def test_values_equal_independent_measurements() -> None:
    registry = CollectorRegistry()
    registry.register(HostPoolCollector())
    with HostPoolManager() as m:
        shm = m.allocator("meas_shm")
        anon = m.allocator("meas_anon", "mmap", populate="none")
        lazy = m.allocator("meas_lazy", "shm", populate="none")
        a = shm.allocate((3 * MiB,), torch.uint8)
        b = anon.allocate((2 * MiB,), torch.uint8)
        c = lazy.allocate((2 * MiB,), torch.uint8)
        b[: 5 * 4096].fill_(1)  # partial touches of populate=none regions
        c[MiB : MiB + 3 * 4096].fill_(1)
        samples = _samples(registry)

        fds = helpers.fd_links("hostpool.meas_shm.")
        assert _value(samples, "hostpool_open_fds", pool="meas_shm") == len(fds) == 2
        fd = shm.fd
        assert fd is not None
        st_blocks = os.fstat(fd).st_blocks * 512
        rss, _ = _smaps_rss(f"hostpool.meas_shm.{os.getpid()}.")
        resident = _value(samples, "hostpool_resident_bytes", pool="meas_shm")
        assert resident == st_blocks == rss == 3 * MiB
        region = anon.regions[0]
        assert (
            _value(samples, "hostpool_resident_bytes", pool="meas_anon")
            == (helpers.mincore_resident(region.facts.address, region.facts.mapped_bytes))
            == 5 * 4096
        )
        assert (
            _value(samples, "hostpool_resident_bytes", pool="meas_lazy")
            == (os.fstat(lazy.fd).st_blocks * 512)
            == 3 * 4096
        )
        assert (
            _value(samples, "hostpool_allocated_bytes", pool="meas_lazy", page_size="4KiB")
            == 2 * MiB
        )
        assert _value(samples, "hostpool_populate_mode", pool="meas_lazy", mode="none") == 1
        assert _value(samples, "hostpool_populate_mode", pool="meas_shm", mode="madvise") == 1
        assert _value(samples, "hostpool_live_allocations", pool="meas_anon", allocator="mmap") == 1
        assert _value(samples, "hostpool_allocation_duration_seconds_count", pool="meas_shm") == 1
        del a, b, c


@pytest.mark.hugepages
def test_hugetlb_resident_is_counted(hugepages_2m: int) -> None:
    registry = CollectorRegistry()
    registry.register(HostPoolCollector())
    with HostPoolManager() as m:
        huge = m.allocator("meas_huge", hugepages="required")
        t = huge.allocate((4 * MiB,), torch.uint8)
        samples = _samples(registry)
        rss, hugetlb = _smaps_rss(f"hostpool.meas_huge.{os.getpid()}.")
        value = _value(samples, "hostpool_resident_bytes", pool="meas_huge", page_size="2MiB")
        assert value == hugetlb == os.fstat(huge.fd).st_blocks * 512 == 4 * MiB
        assert rss == 0  # smaps shows hugetlb pages only under *_Hugetlb
        free = _value(samples, "hostpool_hugepages_free", page_size="2MiB")
        with open("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages") as f:
            free_now = int(f.read())
        with open("/sys/kernel/mm/hugepages/hugepages-2048kB/resv_hugepages") as f:
            free_now -= int(f.read())
        assert free == free_now
        del t


def test_counters_failures_and_releases() -> None:
    registry = CollectorRegistry()
    registry.register(HostPoolCollector())
    with HostPoolManager(budget=MiB) as m:
        alloc = m.allocator("meas_count")
        t = alloc.allocate((4096,), torch.uint8)
        with pytest.raises(Exception):  # noqa: B017 (the typed error is tested elsewhere)
            alloc.allocate((2 * MiB,), torch.uint8)
        alloc.release(t)
        del t
        samples = _samples(registry)
        assert _value(samples, "hostpool_allocations_total", pool="meas_count") == 1
        assert (
            _value(
                samples, "hostpool_allocation_failures_total", pool="meas_count", reason="budget"
            )
            == 1
        )
        assert _value(samples, "hostpool_releases_total", pool="meas_count", how="explicit") == 1
        assert _value(samples, "hostpool_releases_total", pool="meas_count", how="finalizer") == 0
        assert _value(samples, "hostpool_budget_reserved_bytes") >= 0
        assert _value(samples, "hostpool_build_info") == 1


def test_importing_metrics_starts_nothing() -> None:
    code = textwrap.dedent(
        """
        import threading, prometheus_client
        before = len(list(prometheus_client.REGISTRY.collect()))
        import hostpool.metrics, hostpool.multiprocess
        assert threading.active_count() == 1, threading.enumerate()
        assert len(list(prometheus_client.REGISTRY.collect())) == before
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr


WORKER = """
import os, sys, torch
from hostpool import HostPoolManager
from hostpool.multiprocess import MultiprocessPublisher
m = HostPoolManager()
kv = m.allocator("kv").allocate(({kv},), torch.uint8)
own = m.allocator("own_" + sys.argv[1]).allocate(({own},), torch.uint8)
MultiprocessPublisher(interval=0.1).start()
print("ready", flush=True)
sys.stdin.read()
"""


def test_multiprocess_workers_sum_and_vanish(tmp_path: os.PathLike[str]) -> None:
    from prometheus_client import multiprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": os.fspath(tmp_path)}
    workers = []
    for name, kv in (("a", MiB), ("b", 2 * MiB)):
        p = subprocess.Popen(
            [sys.executable, "-c", WORKER.format(kv=kv, own=MiB), name],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        workers.append(p)

    def collect() -> dict[str, list[tuple[dict[str, str], float]]]:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=os.fspath(tmp_path))
        return _samples(registry)

    samples = collect()
    assert _value(samples, "hostpool_allocated_bytes", pool="kv") == 3 * MiB
    assert _value(samples, "hostpool_allocated_bytes", pool="own_a") == MiB
    assert _value(samples, "hostpool_allocated_bytes", pool="own_b") == MiB
    assert all("pid" not in lab for lab, _ in samples["hostpool_allocated_bytes"])
    assert _value(samples, "hostpool_allocations_total", pool="kv") == 2
    dead = workers[1]
    assert dead.stdin is not None
    dead.communicate(timeout=30)  # closes stdin (EOF ends it), reads stdout to the end
    multiprocess.mark_process_dead(dead.pid, path=os.fspath(tmp_path))
    samples = collect()
    assert _value(samples, "hostpool_allocated_bytes", pool="kv") == MiB
    assert not [v for lab, v in samples["hostpool_allocated_bytes"] if lab["pool"] == "own_b"]
    alive = workers[0]
    assert alive.stdin is not None
    alive.communicate(timeout=30)


def _meminfo_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def test_budget_gauge_is_one_series_per_limit_never_above_the_host() -> None:
    from hostpool.core.budget import LIMITS

    registry = CollectorRegistry()
    register_metrics(registry)
    total = _meminfo_total()
    with HostPoolManager() as a, HostPoolManager() as b, HostPoolManager() as c:
        # three managers without a budget: nothing adds up
        kept = [m.allocator("nobudget").allocate((MiB,), torch.uint8) for m in (a, b, c)]
        samples = _samples(registry)
        series = {lab["limit"]: v for lab, v in samples["hostpool_budget_bytes"]}
        assert set(series) <= set(LIMITS) and "memavailable" in series
        assert "configured" not in series  # no manager configured one
        assert all(0 < v <= total for v in series.values()), series
        reserved = _value(samples, "hostpool_budget_reserved_bytes")
        assert reserved >= 3 * MiB
        with HostPoolManager(budget=64 * MiB) as d:
            kept.append(d.allocator("withbudget").allocate((2 * MiB,), torch.uint8))
            samples = _samples(registry)
            series = {lab["limit"]: v for lab, v in samples["hostpool_budget_bytes"]}
            assert series["configured"] == 64 * MiB
            view = d.budget_view()  # what /debug/pools shows
            # Read a moment apart: MemAvailable moves, the set of limits and budgets do not.
            assert set(view.limits) == set(series)
            assert view.limits["configured"] == series["configured"]
            assert view.binding == "configured"
            assert view.reserved == _value(samples, "hostpool_budget_reserved_bytes")
        kept.clear()


PUBLISHER = """
import os, sys, time, torch
from hostpool import HostPoolManager
from hostpool.core.ledger import get_ledger
from hostpool.multiprocess import MultiprocessPublisher
m = HostPoolManager()
kv = m.allocator("timed", "mmap")
kept = [kv.allocate(((1 << 20) * (i + 1),), torch.uint8) for i in range(6)]
MultiprocessPublisher(interval=3600).start()  # only the publish at start can count
counts, total = get_ledger().counters().durations["timed"]
print(repr(total), sum(counts), flush=True)
sys.stdin.read()
"""


def test_multiprocess_publishes_at_start_with_the_true_duration_sum(
    tmp_path: os.PathLike[str],
) -> None:
    from prometheus_client import multiprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": os.fspath(tmp_path)}
    worker = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        total_text, count_text = worker.stdout.readline().split()
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=os.fspath(tmp_path))
        samples = _samples(registry)
        assert _value(samples, "hostpool_allocated_bytes", pool="timed") == 21 * MiB
        count = _value(samples, "hostpool_allocation_duration_seconds_count", pool="timed")
        published = _value(samples, "hostpool_allocation_duration_seconds_sum", pool="timed")
        assert count == int(count_text) == 6
        assert published == pytest.approx(float(total_text), rel=1e-9)
    finally:
        assert worker.stdin is not None
        worker.communicate(timeout=30)  # closes stdin, reads stdout to the end
