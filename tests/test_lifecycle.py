"""The ledger and the manager: ownership, exactly-once release, leaks, fork, churn."""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from hostpool import (
    HostPoolManager,
    ShmHostTensorAllocator,
)
from hostpool.core.budget import admissions
from hostpool.core.ledger import get_ledger
from hostpool.memory.region import Region
from hostpool.share import peers
from tests import helpers

MiB = 1 << 20


def _live_ids() -> set[int]:
    return {r.id for r in get_ledger().snapshot()}


def test_dropping_tensors_inside_a_manager_frees_the_mapping() -> None:
    ledger = get_ledger()
    with HostPoolManager() as manager:
        kv = manager.allocator("kvdrop")
        t = kv.allocate((1 << 20,), torch.uint8)
        region = kv.regions[0]
        before = ledger.counters().releases_total.get(("kvdrop", "tensor"), 0)
        del t
        gc.collect()
        assert not helpers.range_mapped(region.facts.address, region.facts.mapped_bytes)
        assert manager.snapshot() == []
        counters = ledger.counters().releases_total
        # The tensor owned it (the allocator retains nothing): its normal end, no leak.
        assert counters[("kvdrop", "tensor")] == before + 1
        assert counters.get(("kvdrop", "finalizer"), 0) == 0
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
            ok = child.snapshot() == [] and child.counters().releases_total == {}
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
    assert ledger.counters().releases_total == counters_before.releases_total
    alloc.close()
    del t


# Churn over threads, pools and allocator types: tests/reliability/test_churn.py.


def _counter(key: str, pool: str) -> int:
    counts: dict[Any, int] = getattr(get_ledger().counters(), key)
    return counts.get(pool, 0)


def test_close_leaves_alone_an_fd_number_the_kernel_gave_to_another_file(
    tmp_path: Path,
) -> None:
    """The caller closed hostpool's fd (`.fd` handed it out) and the number was reused."""
    alloc = ShmHostTensorAllocator("fdreuse")
    kept = alloc.allocate((4096,), torch.uint8)
    dropped = alloc.allocate((4096,), torch.uint8)
    numbers = alloc.fds
    others = []
    for fd in numbers:
        os.close(fd)  # the caller's mistake
        other = os.open(tmp_path / f"other{fd}", os.O_CREAT | os.O_RDWR)
        if other != fd:
            os.dup2(other, fd)
            os.close(other)
        others.append(fd)
    before = _counter("fd_reuse_skips", "fdreuse")
    try:
        with capture_logs() as logs:
            del dropped  # the finalizer path
            gc.collect()
            alloc.close()  # the explicit path
            get_ledger().drain()
        for fd in others:
            assert os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / f"other{fd}")
        assert _counter("fd_reuse_skips", "fdreuse") == before + 2
        reused = [e for e in logs if e["event"] == "hostpool.fd_reused"]
        assert sorted(e["fd"] for e in reused) == sorted(others)
    finally:
        for fd in others:
            os.close(fd)
    del kept


def test_the_ledger_answers_while_a_region_unmaps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape, a snapshot or an admission never waits for munmap (0.9 s for 4 x 1 GiB):
    while one release is stuck unmapping, the ledger still answers and allocates."""
    ledger = get_ledger()
    unmapping, finish = threading.Event(), threading.Event()
    real_close = Region.close

    def slow_close(self: Region) -> bool:
        unmapping.set()
        finish.wait(60)
        return real_close(self)

    monkeypatch.setattr(Region, "close", slow_close)
    answered: list[object] = []
    with HostPoolManager() as manager:
        alloc = manager.allocator("unlocked")
        t = alloc.allocate((MiB,), torch.uint8)
        releasing = threading.Thread(target=alloc.release, args=(t,))
        releasing.start()
        try:
            assert unmapping.wait(60)
            reader = threading.Thread(
                target=lambda: answered.extend(
                    (ledger.counters(), ledger.snapshot(), alloc.allocate((MiB,), torch.uint8))
                )
            )
            reader.start()
            reader.join(10)
            assert len(answered) == 3, "the ledger waited for an unmap in progress"
        finally:
            finish.set()
            releasing.join(60)
        del t
    answered.clear()


def test_children_forked_while_threads_allocate_can_allocate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every hostpool lock is re-created in a child: 30 of 30 children allocate and exit."""
    # Events stay off: a thread writing to a buffered sys.stderr at fork leaves the
    # stream's own (CPython) lock held in the child; that is not a lock hostpool owns.
    logger = logging.getLogger("hostpool")
    monkeypatch.setattr(logger, "level", logger.level)  # restored afterwards
    logger.setLevel(logging.WARNING)  # setLevel also clears the level cache
    stop = threading.Event()
    errors: list[BaseException] = []
    with HostPoolManager(budget=256 * MiB) as manager:
        allocs = [manager.allocator(f"forkrace{i}", "shm", populate="none") for i in range(2)]
        allocs += [manager.allocator(f"forkrace{i}", "mmap") for i in range(2, 4)]

        def churn(alloc: Any) -> None:
            try:
                while not stop.is_set():
                    t = alloc.allocate((64 << 10,), torch.uint8)
                    alloc.release(t)
                    del t
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(a,)) for a in allocs]
        for th in threads:
            th.start()

        def child() -> str:
            t = allocs[0].allocate((64 << 10,), torch.uint8)
            t.fill_(1)
            return "allocated"

        try:
            results = [helpers.run_forked(child, timeout=20) for _ in range(30)]
        finally:
            stop.set()
            for th in threads:
                th.join()
    assert errors == []
    assert results == [(0, "allocated")] * 30


def test_a_manager_dropped_without_close_is_collected_and_reported() -> None:
    ledger = get_ledger()
    budgets = len(admissions(ledger))
    finalized = ledger.counters().releases_total.get(("dropped", "finalizer"), 0)
    manager = HostPoolManager(budget=64 * MiB)
    alloc = manager.allocator("dropped")
    t = alloc.allocate((MiB,), torch.uint8)
    gone = weakref.ref(manager)
    assert len(admissions(ledger)) == budgets + 1
    del manager, alloc
    gc.collect()
    assert gone() is None  # nothing of hostpool's kept it alive
    with capture_logs() as logs:
        ledger.drain()
    (record,) = [r for r in ledger.snapshot() if r.pool == "dropped"]
    assert record.state == "released_mapped"  # released; t still maps it
    counted = ledger.counters().releases_total[("dropped", "finalizer")]
    assert counted == finalized + 1
    (leak,) = [e for e in logs if e["event"] == "hostpool.leak"]
    assert leak["pool"] == "dropped" and leak["bytes"] == MiB
    assert len(admissions(ledger)) == budgets
    t.fill_(1)  # nothing was unmapped under it
    address = record.address
    del t
    gc.collect()
    assert [r for r in ledger.snapshot() if r.pool == "dropped"] == []
    assert not helpers.range_mapped(address, MiB)


def test_share_sources_are_summed_and_held_weakly() -> None:
    class Server:
        def __init__(self, counts: dict[str, int]) -> None:
            self.counts = counts

        def attached_counts(self) -> dict[str, int]:
            return self.counts

    ledger = get_ledger()
    a, b = Server({"sharedpool": 2}), Server({"sharedpool": 1, "other": 3})
    peers.add_source(ledger, a.attached_counts)
    peers.add_source(ledger, b.attached_counts)
    try:
        seen = peers.attached_clients(ledger)
        assert (seen.get("sharedpool"), seen.get("other")) == (3, 3)  # not last-writer-wins
        dead = weakref.ref(b)
        del b
        gc.collect()
        assert dead() is None
        seen = peers.attached_clients(ledger)
        assert (seen.get("sharedpool"), seen.get("other")) == (2, None)
    finally:
        peers.remove_source(ledger, a.attached_counts)
    assert "sharedpool" not in peers.attached_clients(ledger)


def test_close_while_an_allocation_is_in_flight_leaves_nothing_live(
    monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    """Issue 26 point 4: a region committed after `close()` stayed live, missing from the
    LeakReport, and later counted as a leak. The allocation is held inside populate (a
    real memfd, mapped) while the manager closes: it must be refused and undone."""
    from hostpool.errors import InvalidRequestError
    from hostpool.memory import create

    entered, proceed = threading.Event(), threading.Event()
    real_populate = create._populate

    def populate_when_told(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert proceed.wait(120), "never told to proceed"
        return real_populate(*args, **kwargs)

    monkeypatch.setattr(create, "_populate", populate_when_told)
    ledger = get_ledger()
    before = ledger.counters()
    manager = HostPoolManager()
    alloc = manager.allocator("close_race")
    outcome: dict[str, Any] = {}

    def allocate() -> None:
        try:
            outcome["tensor"] = alloc.allocate((1 << 20,), torch.uint8)
        except InvalidRequestError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=allocate)
    worker.start()
    assert entered.wait(120), "the allocation never reached populate"
    assert len(helpers.fd_links("hostpool.close_race.")) == 2  # the memfd and mmap's dup
    report = manager.close()
    proceed.set()
    worker.join(120)
    assert not worker.is_alive()
    assert not report  # nothing was live when it closed
    assert "tensor" not in outcome, "an allocation committed after close()"
    assert "closed" in str(outcome["error"])
    outcome.clear()  # the error's traceback holds frames of the allocation
    gc.collect()
    after = ledger.counters()
    assert ledger.snapshot(["close_race"]) == []
    assert helpers.fd_links("hostpool.close_race.") == {}
    assert helpers.maps_lines("hostpool.close_race.") == []
    key = ("close_race", "invalid")
    assert after.failures_total.get(key, 0) == before.failures_total.get(key, 0) + 1
    # Never recorded, so never released either way: no count of any kind moved.
    for how in ("explicit", "tensor", "finalizer"):
        assert after.releases_total.get(("close_race", how), 0) == 0
    assert after.allocations_total.get(("close_race", "shm"), 0) == 0
    assert manager.budget_reserved_bytes == 0
