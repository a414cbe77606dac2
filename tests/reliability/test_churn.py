"""Churn: many allocate/release cycles over threads, pools and every allocator type, with a
thread scraping the collector and a thread forking children that allocate, all at once;
at the end every gauge equals what /proc shows."""

from __future__ import annotations

import logging
import math
import os
import random
import select
import threading
import time
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from hostpool import HostPoolManager
from hostpool.core.ledger import get_ledger
from hostpool.metrics import HostPoolCollector, register_metrics
from tests import helpers, waiting
from tests.reliability.conftest import SOAK, record_churn

CYCLES = 100_000 if SOAK else 10_000
THREADS = 8
KINDS = ("shm", "mmap", "default")
SIGNATURE = b"hostpool"
MiB = 1 << 20


def still_marked(start: int, mark: bytes, mem_fd: int) -> bool:
    """Whether `mark` is still at `start`: read through /proc/self/mem, which answers EIO
    for an unmapped address instead of faulting."""
    try:
        return os.pread(mem_fd, len(mark), start) == mark
    except OSError:
        return False


def _gauges(registry: CollectorRegistry, pools: list[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            pool = sample.labels.get("pool")
            if pool in pools and sample.name in (
                "hostpool_allocated_bytes",
                "hostpool_resident_bytes",
                "hostpool_open_fds",
                "hostpool_live_allocations",
            ):
                by_pool = out.setdefault(sample.name, {})
                by_pool[pool] = by_pool.get(pool, 0.0) + sample.value
    return out


def _resident(address: int, length: int) -> int:
    """mincore over the pages a buffer touches (torch's may start mid-page)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = address & ~(page - 1)
    return min(length, helpers.mincore_resident(start, address + length - start))


def _proc_view(pools: list[str], live: dict[str, list[Any]]) -> dict[str, dict[str, float]]:
    """The same gauges from /proc/self/fd, fstat and mincore, never from hostpool."""
    out: dict[str, dict[str, float]] = {
        "hostpool_allocated_bytes": {},
        "hostpool_resident_bytes": {},
        "hostpool_open_fds": {},
        "hostpool_live_allocations": {},
    }
    links = helpers.fd_links()
    for pool in pools:
        fds = [fd for fd, target in links.items() if f"hostpool.{pool}." in target]
        out["hostpool_open_fds"][pool] = float(len(fds))
        tensors = live[pool]
        out["hostpool_live_allocations"][pool] = float(len(tensors))
        out["hostpool_allocated_bytes"][pool] = float(sum(t.nbytes for t in tensors))
        if fds:  # shm: the backing file's blocks, each inode once
            inodes = {}
            for fd in fds:
                st = os.fstat(fd)
                inodes[(st.st_dev, st.st_ino)] = st.st_blocks * 512
            resident = sum(inodes.values())
        else:
            resident = sum(_resident(t.data_ptr(), t.nbytes) for t in tensors)
        out["hostpool_resident_bytes"][pool] = float(resident)
    return out


def test_churn_counts_balance_and_nothing_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    # Events off: a thread writing to a buffered stream at fork leaves CPython's stream
    # lock held in the child (not a lock hostpool owns); 10,000 debug events cost too.
    logger = logging.getLogger("hostpool")
    monkeypatch.setattr(logger, "level", logger.level)
    logger.setLevel(logging.WARNING)
    ledger = get_ledger()
    before = ledger.counters()
    pools = [f"rchurn{i}" for i in range(4)]
    recorded: dict[tuple[int, int], bytes] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    done = threading.Event()
    scrapes = forks = 0
    registry = CollectorRegistry()
    started = time.monotonic()
    with HostPoolManager() as manager:
        register_metrics(registry, ledger=ledger)
        allocators = [
            manager.allocator(pool, KINDS[i % 3], populate="none" if i % 2 else "auto")
            for i, pool in enumerate(pools)
        ]

        def scrape() -> None:
            nonlocal scrapes
            collector = HostPoolCollector(ledger)
            try:
                while not done.is_set():
                    list(collector.collect())
                    scrapes += 1
            except BaseException as exc:
                errors.append(exc)

        def fork() -> None:
            # Children forked mid-churn allocate through the same allocators and exit.
            nonlocal forks
            try:
                while not done.wait(0.05):
                    pid = os.fork()
                    if pid == 0:
                        code = 1
                        try:
                            for alloc in allocators:
                                alloc.allocate_region((4096,), torch.uint8, "cpu")
                            code = 0
                        finally:
                            os._exit(code)
                    # its exit is an event (the pidfd turns readable); the deadline only
                    # tells a hung child from a slow one on a busy machine
                    pidfd = os.pidfd_open(pid)
                    try:
                        if not select.select([pidfd], [], [], waiting.DEADLINE)[0]:
                            os.kill(pid, 9)
                            os.waitpid(pid, 0)
                            raise AssertionError(f"forked child {pid} hung")
                    finally:
                        os.close(pidfd)
                    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                    assert code == 0, f"forked child failed: exit {code}"
                    forks += 1
            except BaseException as exc:
                errors.append(exc)

        def work(seed: int) -> None:
            rng = random.Random(seed)
            views: list[torch.Tensor] = []
            try:
                for _ in range(CYCLES // THREADS):
                    alloc = rng.choice(allocators)
                    # log-uniform 4 KiB .. 64 MiB; the large end is rare, as in a server
                    nbytes = int(math.exp(rng.uniform(math.log(4096), math.log(64 << 20))))
                    t, region = alloc.allocate_region((nbytes,), torch.uint8, "cpu")
                    if region.facts.kind != "torch":
                        # A signature at the start tells a leaked region from a later,
                        # unrelated mapping that happens to get the same address range.
                        mark = SIGNATURE + region.facts.id.to_bytes(8, "little")
                        t[:16].copy_(torch.frombuffer(bytearray(mark), dtype=torch.uint8))
                        with lock:
                            recorded[
                                (
                                    region.facts.address,
                                    region.facts.address + region.facts.mapped_bytes,
                                )
                            ] = mark
                    del region
                    roll = rng.random()
                    if roll < 0.5:
                        alloc.release(t)
                    elif roll < 0.7:
                        views.append(t[:64])  # a view kept past release
                        alloc.release(t)
                    # else dropped without release: the tensor's end (it owned it)
                    del t
                    if len(views) > 16:
                        views.clear()
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(THREADS)]
        extra = [threading.Thread(target=scrape), threading.Thread(target=fork)]
        for th in threads + extra:
            th.start()
        for th in threads:
            th.join()
        done.set()
        for th in extra:
            th.join()
        assert errors == []
        assert scrapes > 0 and forks > 0
        # At rest with some allocations live: every gauge equals what /proc shows.
        live = {
            p: [a.allocate((MiB * (i + 1),), torch.uint8)]
            for i, (p, a) in enumerate(zip(pools, allocators, strict=True))
        }
        assert _gauges(registry, pools) == _proc_view(pools, live)
        live.clear()
    seconds = time.monotonic() - started
    after = ledger.counters()

    def delta(key: str, label: str) -> int:
        return sum(
            getattr(after, key).get((p, label), 0) - getattr(before, key).get((p, label), 0)
            for p in pools
        )

    made = sum(delta("allocations_total", k) for k in ("shm", "mmap", "default"))
    assert made == CYCLES + 4  # and the four at rest
    assert made == delta("releases_total", "explicit") + delta("releases_total", "tensor")
    assert delta("releases_total", "finalizer") == 0  # nothing here is a leak
    # Shared memfd regions show by name (the fixture checks /proc/self/maps for them);
    # anonymous ones by the signature at their start, whatever maps that address now.
    mem_fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        still = [span for span, mark in recorded.items() if still_marked(span[0], mark, mem_fd)]
    finally:
        os.close(mem_fd)
    assert still == []
    record_churn(
        CYCLES, seconds, threads=THREADS, scrapes=scrapes, forks=forks, gauges_equal_proc=True
    )
