"""`hostpool exporter --node`: the host view as metrics.

The collector's sums over views made up here (every kind, state, hugetlb, ages), its
families against metrics/README.md's catalogue, and the real exporter, a subprocess
scraped over HTTP, against real objects (a memfd a child holds, an orphaned
`vllm_offload_*.mmap` in /dev/shm, an unattached SysV segment) and the real scan.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest
from prometheus_client import CollectorRegistry

from hostpool.host.bounds import PHASES
from hostpool.host.model import (
    AREAS,
    ENGINES,
    OBJECT_KINDS,
    Engine,
    Holder,
    HostObject,
    HostTotals,
    HostView,
    ObjectKind,
)
from hostpool.host.pods import parse_cgroup
from hostpool.metrics.host import HOST_METRICS, HostCollector
from tests import dashboard_lint as lint
from tests import exporting, helpers
from tests.helpers import start_exporter
from tests.readerscan import scan_as_reader
from tests.waiting import wait_for

__all__ = ["start_exporter"]  # the fixture
MiB = 1 << 20
LABEL_VALUES = {
    "engine": set(ENGINES),
    "kind": set(OBJECT_KINDS),
    "state": {"held", "orphaned"},
    "area": {"", *AREAS},
    "phase": set(PHASES),
}
POD_A, POD_B = "0b6f1c2e-1111-4222-8333-444455556666", "7d1e2f3a-1111-4222-8333-444455556666"


def label_ok(label: str, value: str) -> bool:
    """A fixed set's value; `pod_uid` "" or a uid as the node's cgroups write it."""
    if label == "pod_uid":
        slice_ = f"0::/kubepods.slice/kubepods-pod{value.replace('-', '_')}.slice\n"
        return value == "" or parse_cgroup(slice_.encode()).pod_uid == value
    return value in LABEL_VALUES[label]


def obj(
    kind: ObjectKind,
    engine: Engine,
    resident: int,
    *,
    held: bool = True,
    age: float | None = None,
    hugetlb: bool = False,
    name: str = "x",
    pod: str | None = None,
) -> HostObject:
    holders = (Holder(pid=4242, comm="python3", fds=1, mappings=1, pod_uid=pod),) if held else ()
    return HostObject(
        kind=kind,
        name=name,
        path=f"/dev/shm/{name}" if kind == "file" else None,
        engine=engine,
        pool=None,
        size_bytes=2 * resident,
        resident_bytes=resident,
        holders=holders,
        orphan=not held,
        age_seconds=age,
        hugetlb=hugetlb,
        area=("hugetlbfs" if hugetlb else "dev_shm") if kind == "file" else None,
        pod_uid=pod,
    )


def view(*objects: HostObject, shmem: int) -> HostView:
    attributed = sum(o.resident_bytes for o in objects if not o.hugetlb)
    totals = HostTotals(
        shmem_bytes=shmem,
        attributed_bytes=attributed,
        unattributed_bytes=max(0, shmem - attributed),
        orphaned_bytes=sum(o.resident_bytes for o in objects if o.orphan and not o.hugetlb),
        hugetlb_bytes=sum(o.resident_bytes for o in objects if o.hugetlb),
        hugetlb_orphaned_bytes=sum(o.resident_bytes for o in objects if o.orphan and o.hugetlb),
    )
    return HostView(objects=objects, totals=totals)


SEEN = view(
    obj("memfd", "hostpool", 4 * MiB, name="hostpool.kv.77.0"),
    obj("memfd", "hostpool", 2 * MiB, name="hostpool.kv.77.1"),
    obj("memfd", "sglang", 1 * MiB, name="sglang_host_pool_00"),
    obj("file", "vllm", 8 * MiB, held=False, age=7200.0, name="vllm_offload_a.mmap"),
    obj("file", "vllm", 3 * MiB, held=False, age=60.0, name="vllm_offload_b.mmap"),
    obj("file", "vllm", 5 * MiB, name="vllm_offload_c.mmap"),
    obj("sysv", "unknown", 1 * MiB, held=False, age=None, name="SYSV00000000"),
    obj("anon_shared", "unknown", 64 * 1024),
    obj("memfd", "hostpool", 2 * MiB, hugetlb=True, name="hostpool.huge.77.0"),
    obj("sysv", "unknown", 4 * MiB, held=False, age=900.0, hugetlb=True),
    shmem=40 * MiB,
)


def collected(v: HostView, **kwargs: float) -> dict[str, dict[tuple[str, ...], float]]:
    registry = CollectorRegistry()
    registry.register(HostCollector(scan=lambda *, deadline: v, **kwargs))
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in registry.collect():
        names = HOST_METRICS[family.name][0]
        for s in family.samples:
            assert set(s.labels) == set(names), s
            out.setdefault(family.name, {})[tuple(s.labels[n] for n in names)] = s.value
    return out


def test_sums_by_engine_kind_and_state_hugetlb_apart() -> None:
    got = collected(SEEN)
    assert got["hostpool_host_shm_bytes"] == {
        ("hostpool", "memfd", "held", "", ""): 6 * MiB,
        ("sglang", "memfd", "held", "", ""): 1 * MiB,
        ("vllm", "file", "held", "dev_shm", ""): 5 * MiB,
        ("vllm", "file", "orphaned", "dev_shm", ""): 11 * MiB,
        ("unknown", "sysv", "orphaned", "", ""): 1 * MiB,
        ("unknown", "anon_shared", "held", "", ""): 64 * 1024,
    }
    assert got["hostpool_host_shm_objects"] == {
        ("hostpool", "memfd", "held", "", ""): 2,
        ("sglang", "memfd", "held", "", ""): 1,
        ("vllm", "file", "held", "dev_shm", ""): 1,
        ("vllm", "file", "orphaned", "dev_shm", ""): 2,
        ("unknown", "sysv", "orphaned", "", ""): 1,
        ("unknown", "anon_shared", "held", "", ""): 1,
    }
    assert got["hostpool_host_hugetlb_bytes"] == {
        ("hostpool", "memfd", "held"): 2 * MiB,
        ("unknown", "sysv", "orphaned"): 4 * MiB,
    }
    # the oldest orphan whose age is known, hugetlb ones included; no series without one
    assert got["hostpool_host_shm_oldest_orphan_age_seconds"] == {
        ("vllm",): 7200.0,
        ("unknown",): 900.0,
    }
    assert got["hostpool_host_shmem_bytes"] == {(): 40 * MiB}
    # the accounting closes: what the objects hold plus what none does is Shmem
    attributed = sum(got["hostpool_host_shm_bytes"].values())
    unattributed = got["hostpool_host_shmem_unattributed_bytes"][()]
    assert attributed + unattributed == 40 * MiB
    assert unattributed == SEEN.totals.unattributed_bytes > 0
    assert got["hostpool_host_scrape_truncated"] == {(): 0}
    assert got["hostpool_host_unreadable_processes"] == {(): 0}
    assert got["hostpool_host_scrape_duration_seconds"][()] >= 0


def test_label_values_come_from_the_fixed_sets_and_never_name_an_object() -> None:
    """Every engine x kind x state there can be: as many series as combinations, no
    more, and no name, path or pid in any label."""
    objects = []
    for engine in ENGINES:
        for kind in OBJECT_KINDS:
            for i in range(3):  # several objects per combination: still one series
                objects.append(obj(kind, engine, MiB, held=i != 1, age=float(i), name=f"n{i}"))
    got = collected(view(*objects, shmem=0))
    for name, series in got.items():
        for labels in series:
            for label, value in zip(HOST_METRICS[name][0], labels, strict=True):
                assert label_ok(label, value), (name, label, value)
    assert len(got["hostpool_host_shm_objects"]) == len(ENGINES) * len(OBJECT_KINDS) * 2
    assert sum(got["hostpool_host_shm_objects"].values()) == len(objects)
    assert got["hostpool_host_shmem_unattributed_bytes"] == {(): 0}  # never negative


def test_objects_are_summed_per_pod_and_area() -> None:
    """`pod_uid` and `area` split the object families: one series per pod (and "" for
    no pod's) that has objects, summing back to the host's; hugetlb has no pod label."""
    got = collected(
        view(
            obj("memfd", "vllm", 4 * MiB, pod=POD_A),
            obj("memfd", "vllm", 2 * MiB, pod=POD_A),
            obj("memfd", "vllm", 1 * MiB, pod=POD_B),
            obj("file", "vllm", 8 * MiB, held=False, age=60.0, pod=POD_A),
            obj("file", "vllm", 3 * MiB, held=False, age=60.0),
            replace(obj("file", "unknown", MiB, pod=POD_B), area="kubelet_volume"),
            obj("memfd", "vllm", 2 * MiB, hugetlb=True, pod=POD_A),
            shmem=40 * MiB,
        )
    )
    assert got["hostpool_host_shm_bytes"] == {
        ("vllm", "memfd", "held", "", POD_A): 6 * MiB,
        ("vllm", "memfd", "held", "", POD_B): 1 * MiB,
        ("vllm", "file", "orphaned", "dev_shm", ""): 3 * MiB,
        ("vllm", "file", "orphaned", "dev_shm", POD_A): 8 * MiB,
        ("unknown", "file", "held", "kubelet_volume", POD_B): 1 * MiB,
    }
    assert list(got["hostpool_host_shm_objects"].values()) == [2, 1, 1, 1, 1]
    assert got["hostpool_host_hugetlb_bytes"] == {("vllm", "memfd", "held"): 2 * MiB}


def test_an_empty_host_has_totals_and_no_object_series() -> None:
    got = collected(view(shmem=123 * 4096))
    for name in (
        "hostpool_host_shm_bytes",
        "hostpool_host_shm_objects",
        "hostpool_host_hugetlb_bytes",
        "hostpool_host_shm_oldest_orphan_age_seconds",
    ):
        assert name not in got
    assert got["hostpool_host_shmem_bytes"] == {(): 123 * 4096}
    assert got["hostpool_host_shmem_unattributed_bytes"] == {(): 123 * 4096}


def test_a_reading_past_its_budget_is_flagged() -> None:
    def slow(*, deadline: float) -> HostView:
        while time.monotonic() <= deadline:  # a scan that used its whole budget
            time.sleep(0.001)
        return replace(SEEN, complete=False, unreadable=3)

    registry = CollectorRegistry()
    registry.register(HostCollector(scan=slow, scrape_budget=0.01))
    got = {s.name: s.value for family in registry.collect() for s in family.samples if not s.labels}
    assert got["hostpool_host_scrape_truncated"] == 1
    assert got["hostpool_host_scrape_duration_seconds"] > 0.01
    assert got["hostpool_host_unreadable_processes"] == 3


@pytest.mark.parametrize("budget", [0.0, -1.0, float("nan")])
def test_a_budget_must_be_positive(budget: float) -> None:
    from hostpool.errors import ConfigError

    scan: Callable[..., HostView] = lambda *, deadline: SEEN  # noqa: E731
    with pytest.raises(ConfigError, match="scrape_budget"):
        HostCollector(scan=scan, scrape_budget=budget)


def test_what_the_collector_exposes_is_the_documented_catalogue() -> None:
    """metrics/README.md's `hostpool_host_*` rows, read independently of the library:
    exactly the families the collector describes and collects, gauges, same labels."""
    catalogue = {n: m for n, m in lint.load_catalogue().items() if n.startswith("hostpool_host_")}
    registry = CollectorRegistry()
    collector = HostCollector(scan=lambda *, deadline: SEEN)
    registry.register(collector)
    families = {f.name: f for f in registry.collect()}
    assert set(families) == set(catalogue) == {f.name for f in collector.describe()}
    for name, family in families.items():
        assert family.type == catalogue[name].type == "gauge", name
        assert family.samples, name  # SEEN has a sample of every family
        for sample in family.samples:
            assert tuple(sorted(sample.labels)) == tuple(sorted(catalogue[name].labels)), sample


# ---------------------------------------------------------------- the real exporter

PAGE = os.sysconf("SC_PAGE_SIZE")
OBJECT_FAMILIES = (
    "hostpool_host_shm_bytes",
    "hostpool_host_shm_objects",
    "hostpool_host_hugetlb_bytes",
    "hostpool_host_shm_oldest_orphan_age_seconds",
)
Series = dict[tuple[str, tuple[str, ...]], float]

# A hostpool-named memfd, mapped, 5 pages touched, held until stdin closes.
HOLDER = """
import mmap, os, sys
fd = os.memfd_create(f"hostpool.node{sys.argv[1]}.{os.getpid()}.0", os.MFD_CLOEXEC)
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20)
for off in range(0, 5 * mmap.PAGESIZE, mmap.PAGESIZE):
    mm[off] = 1
print("ready", flush=True)
sys.stdin.readline()
"""


@dataclass
class Objects:
    tag: str
    holder: subprocess.Popen[str]
    orphan_path: str
    orphan_bytes: int  # st_blocks of the orphaned file
    shmid: int
    changed: float  # the orphaned file's ctime: its age counts from here (its mtime is older)


@pytest.fixture
def objects() -> Iterator[Objects]:
    """A memfd a child holds; vLLM's offload file left in /dev/shm by no one (its mtime an
    hour back, as `cp -a` leaves it: its age still counts from its ctime); a SysV segment
    with 7 pages touched and no attachment. All removed after."""
    tag = secrets.token_hex(6)
    holder = helpers.python_child(HOLDER, tag)
    path = f"/dev/shm/vllm_offload_{tag}.mmap"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"\1" * (2 * MiB + 3 * PAGE))
        finally:
            os.close(fd)
        os.utime(path, (time.time() - 3600, time.time() - 3600))
        st = os.stat(path)
        with helpers.sysv_segment(MiB, 7 * PAGE) as shmid:
            yield Objects(tag, holder, path, st.st_blocks * 512, shmid, st.st_ctime)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        holder.kill()
        holder.wait()


def scan_series(view: HostView) -> Series:
    """The object families' series of a view, summed here, independently of the
    collector: {(family, label values): value}."""
    out: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
    for o in view.objects:
        key = (o.engine, o.kind, "orphaned" if o.orphan else "held")
        if o.hugetlb:
            out[("hostpool_host_hugetlb_bytes", key)] += o.resident_bytes
        else:
            placed = (*key, o.area or "", o.pod_uid or "")
            out[("hostpool_host_shm_bytes", placed)] += o.resident_bytes
            out[("hostpool_host_shm_objects", placed)] += 1
        if o.orphan and o.age_seconds is not None:
            age = ("hostpool_host_shm_oldest_orphan_age_seconds", (o.engine,))
            out[age] = max(out[age], o.age_seconds)
    return dict(out)


def scraped_series(samples: exporting.Samples) -> Series:
    out: Series = {}
    for (name, labels), v in samples.items():
        if name in OBJECT_FAMILIES:
            names = HOST_METRICS[name][0]
            assert {k for k, _ in labels} == set(names), (name, labels)
            label_map = dict(labels)
            out[(name, tuple(label_map[n] for n in names))] = v
    return out


def summed(series: Series, name: str, *engine_kind_state: str) -> float:
    """A family's series of one engine, kind and state, summed over areas and pods."""
    return sum(
        v for (n, labels), v in series.items() if (n, labels[:3]) == (name, engine_kind_state)
    )


def meminfo_shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def between(got: float, a: float, b: float) -> bool:
    return min(a, b) <= got <= max(a, b)


def test_the_node_view_is_the_scan_of_the_real_host(
    objects: Objects, start_exporter: Callable[..., str]
) -> None:
    """Every series lies between a scan made just before the scrape and one just after
    (the host does not stand still: other processes come and go), read again until both
    scans bracket it; the objects made here are in it; no name, path or pid in a label."""
    url = start_exporter("--node")
    last: dict[str, object] = {}
    started = time.time()

    def bracketed() -> tuple[str, exporting.Samples] | None:
        # scanned with the exporter's reader's capabilities (tests/readerscan)
        shmem_before, before = meminfo_shmem(), scan_series(scan_as_reader())
        text, samples = exporting.scrape(url)
        after, shmem_after = scan_series(scan_as_reader()), meminfo_shmem()
        got = scraped_series(samples)
        outside = {
            key: (got.get(key, 0.0), before.get(key, 0.0), after.get(key, 0.0))
            for key in {*got, *before, *after}
            if not between(got.get(key, 0.0), before.get(key, 0.0), after.get(key, 0.0))
        }
        # a series only where there are objects (and an age only where one is known)
        outside.update({key: (got[key], 0.0, 0.0) for key in got if key not in before | after})
        shmem = exporting.value(samples, "hostpool_host_shmem_bytes")
        if not between(shmem, shmem_before, shmem_after):
            outside[("hostpool_host_shmem_bytes", ())] = (shmem, shmem_before, shmem_after)
        last["outside"] = outside
        return (text, samples) if not outside else None

    try:
        text, samples = wait_for(bracketed, "a scrape between two like scans", interval=0.2)
    except AssertionError:
        raise AssertionError(f"outside the scans: {last.get('outside')}") from None
    got = scraped_series(samples)
    # what this test made is there
    assert (
        summed(got, "hostpool_host_shm_bytes", "vllm", "file", "orphaned") >= objects.orphan_bytes
    )
    assert objects.orphan_bytes >= 2 * MiB + 3 * PAGE
    assert summed(got, "hostpool_host_shm_objects", "vllm", "file", "orphaned") >= 1
    # age is the newest of mtime and ctime: the backdated mtime does not make it older
    assert got[("hostpool_host_shm_oldest_orphan_age_seconds", ("vllm",))] >= (
        started - objects.changed
    )
    assert summed(got, "hostpool_host_shm_bytes", "hostpool", "memfd", "held") >= 5 * PAGE
    assert summed(got, "hostpool_host_shm_bytes", "unknown", "sysv", "orphaned") >= 7 * PAGE
    # the accounting closes within one scrape
    attributed = sum(v for (name, _), v in got.items() if name == "hostpool_host_shm_bytes")
    shmem = exporting.value(samples, "hostpool_host_shmem_bytes")
    unattributed = exporting.value(samples, "hostpool_host_shmem_unattributed_bytes")
    assert unattributed == max(0.0, shmem - attributed)
    assert exporting.value(samples, "hostpool_host_scrape_truncated") == 0
    # labels: the fixed sets only; nothing a process chose, no pid
    for (name, labels), _v in samples.items():
        if name.startswith("hostpool_host_"):
            for label, label_value in labels:
                assert label_ok(label, label_value), (name, label, label_value)
    assert objects.tag not in text and "vllm_offload_" not in text
    assert f'"{objects.holder.pid}"' not in text and "/dev/shm" not in text


def test_node_with_pid_exports_both_views(
    objects: Objects, start_exporter: Callable[..., str]
) -> None:
    pid = objects.holder.pid
    url = start_exporter("--node", "--pid", str(pid))
    _, samples = exporting.scrape(url)
    assert exporting.value(samples, "hostpool_exporter_target_up", pid=str(pid)) == 1
    pool = {"prefix": "hostpool.", "pool": f"node{objects.tag}"}
    assert exporting.value(samples, "hostpool_exporter_resident_bytes", **pool) == 5 * PAGE
    held = summed(scraped_series(samples), "hostpool_host_shm_bytes", "hostpool", "memfd", "held")
    assert held >= 5 * PAGE
    assert exporting.value(samples, "hostpool_host_shmem_bytes") > 0
    # --match with --node too; only --node adds the host view
    _, matched = exporting.scrape(start_exporter("--match", "hostpool.node", "--node"))
    assert exporting.value(matched, "hostpool_exporter_processes", prefix="hostpool.node") >= 1
    assert exporting.value(matched, "hostpool_host_shmem_bytes") > 0
    _, alone = exporting.scrape(start_exporter("--pid", str(pid)))
    assert not [key for key in alone if key[0].startswith("hostpool_host_")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "say what to watch: --pid PID, --match PREFIX, --node"),
        (("--pid", "1", "--match", "x", "--node"), "not allowed with argument"),
    ],
)
def test_what_to_watch_is_one_line_usage_error(args: tuple[str, ...], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hostpool", "exporter", *args, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr.splitlines()[-1] and "Traceback" not in result.stderr
