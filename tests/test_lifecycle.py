"""The ledger and the manager: ownership, exactly-once release, leaks, fork, churn."""

from __future__ import annotations

import gc
import os

import torch

from hostpool import (
    HostPoolManager,
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


# Churn over threads, pools and allocator types: tests/reliability/test_churn.py.
