"""The ledger and the manager: ownership, exactly-once release, leaks, fork, churn."""

from __future__ import annotations

import gc
import math
import os
import random
import threading

import torch

from hostpool import (
    DefaultHostTensorAllocator,
    HostPoolManager,
    MmapHostTensorAllocator,
    ShmHostTensorAllocator,
)
from hostpool.lifecycle import get_ledger
from tests import helpers


def _live_ids() -> set[int]:
    return {r.id for r in get_ledger().snapshot()}


def test_dropping_tensors_inside_a_manager_frees_the_mapping() -> None:
    ledger = get_ledger()
    with HostPoolManager() as manager:
        kv = manager.allocator("kvdrop")
        t = kv.allocate((1 << 20,), torch.uint8)
        region = kv.regions[0]
        before = ledger.counters()["releases_total"].get(("kvdrop", "finalizer"), 0)
        del t
        gc.collect()
        assert not helpers.range_mapped(region.address, region.mapped_bytes)
        assert manager.snapshot() == []
        counted = ledger.counters()["releases_total"][("kvdrop", "finalizer")]
        assert counted == before + 1
        assert region.fd is None  # the finalizer closed hostpool's own fd


def test_close_with_a_live_tensor_reports_the_leak_with_its_stack() -> None:
    manager = HostPoolManager(track_stacks=True)
    t = manager.allocator("leaky").allocate((3, 4096), torch.float32)
    report = manager.close()
    assert report
    (leak,) = report.leaks
    assert leak.pool == "leaky" and leak.mapped_bytes == 3 * 4096 * 4
    text = str(report)
    assert "pool leaky" in text and "49152 bytes" in text
    assert "test_close_with_a_live_tensor_reports_the_leak_with_its_stack" in text
    (record,) = [r for r in get_ledger().snapshot() if r.id == leak.id]
    assert record.state == "released_mapped"
    t.fill_(1.0)  # still usable: nothing was unmapped under it
    address = record.address
    del t
    gc.collect()
    assert leak.id not in _live_ids()
    assert not helpers.range_mapped(address, leak.mapped_bytes)


def test_two_managers_are_views_of_one_ledger() -> None:
    with HostPoolManager() as a, HostPoolManager() as b:
        ta = a.allocator("view_a").allocate((4096,), torch.uint8)
        tb = b.allocator("view_b", "mmap").allocate((4096,), torch.uint8)
        pools = {r.pool for r in get_ledger().snapshot()}
        assert {"view_a", "view_b"} <= pools
        assert {r.pool for r in a.snapshot()} == {"view_a"}
        assert {r.pool for r in b.snapshot()} == {"view_b"}
        del ta, tb


def test_forked_child_neither_releases_nor_counts_parent_regions() -> None:
    ledger = get_ledger()
    alloc = ShmHostTensorAllocator("forked")
    t = alloc.allocate((1 << 16,), torch.uint8)
    counters_before = ledger.counters()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop and close everything it inherited, then report
        try:
            alloc.close()
            child_t = t
            del child_t
            gc.collect()
            child = get_ledger()
            ok = child.snapshot() == [] and child.counters()["releases_total"] == {}
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    (record,) = [x for x in ledger.snapshot() if x.pool == "forked"]
    assert record.state == "live"
    assert os.fstat(alloc.fd).st_size == 1 << 16  # the parent's fd is untouched
    assert ledger.counters()["releases_total"] == counters_before["releases_total"]
    alloc.close()
    del t


def test_churn_over_threads_leaves_nothing_behind() -> None:
    """10,000 allocate/release cycles, 8 threads, 4 pools, every allocator type."""
    ledger = get_ledger()
    gc.collect()
    ledger.drain()
    fds_before = helpers.fd_links()
    ids_before = _live_ids()
    counters_before = ledger.counters()
    pools = ["churn0", "churn1", "churn2", "churn3"]
    kinds = [ShmHostTensorAllocator, MmapHostTensorAllocator, DefaultHostTensorAllocator]
    allocators = [kinds[i % 3](p) for i, p in enumerate(pools)] + [
        ShmHostTensorAllocator("churn3", populate="none")
    ]
    recorded: list[tuple[int, int]] = []
    lock = threading.Lock()
    cycles_per_thread = 10_000 // 8

    def work(seed: int) -> None:
        rng = random.Random(seed)
        kept: list[torch.Tensor] = []
        for _ in range(cycles_per_thread):
            alloc = rng.choice(allocators)
            nbytes = int(math.exp(rng.uniform(math.log(4096), math.log(4 << 20))))
            t, region = alloc._allocate((nbytes,), torch.uint8, "cpu")
            if region.kind != "torch":
                with lock:
                    recorded.append((region.address, region.address + region.mapped_bytes))
            del region
            roll = rng.random()
            if roll < 0.6:
                alloc.release(t)
            elif roll < 0.8:
                kept.append(t[:16])  # a view kept past release
                alloc.release(t)
            # else: dropped without close (the finalizer releases it)
            del t
            if len(kept) > 8:
                kept.clear()

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gc.collect()
    ledger.drain()
    assert helpers.fd_links() == fds_before
    assert _live_ids() == ids_before
    # Address space is reused once freed, so look for the exact ranges; CPython's own
    # obmalloc arenas are 1 MiB anonymous mappings, so that one size cannot be told apart.
    candidates = {r for r in recorded if r[1] - r[0] != 1 << 20}
    assert candidates & set(helpers.mapped_ranges()) == set()
    assert helpers.maps_lines("hostpool.churn") == []
    after = ledger.counters()

    def delta(key: str, pool: str, label: str) -> int:
        return after[key].get((pool, label), 0) - counters_before[key].get((pool, label), 0)

    made = sum(delta("allocations_total", p, k) for p in pools for k in ("shm", "mmap", "default"))
    explicit = sum(delta("releases_total", p, "explicit") for p in pools)
    finalized = sum(delta("releases_total", p, "finalizer") for p in pools)
    assert made == 8 * cycles_per_thread
    assert made == explicit + finalized  # + live, which is zero now
    assert finalized > 0 and explicit > 0
