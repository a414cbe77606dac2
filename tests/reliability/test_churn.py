"""Churn: many allocate/release cycles over threads, pools and every allocator type."""

from __future__ import annotations

import math
import os
import random
import threading
import time

import torch

from hostpool import HostPoolManager
from hostpool.lifecycle import get_ledger
from tests.reliability.conftest import SOAK, record_churn

CYCLES = 100_000 if SOAK else 10_000
THREADS = 8
KINDS = ("shm", "mmap", "default")
SIGNATURE = b"hostpool"


def still_marked(start: int, mark: bytes, mem_fd: int) -> bool:
    """Whether `mark` is still at `start`: read through /proc/self/mem, which answers EIO
    for an unmapped address instead of faulting."""
    try:
        return os.pread(mem_fd, len(mark), start) == mark
    except OSError:
        return False


def test_churn_counts_balance_and_nothing_is_left() -> None:
    ledger = get_ledger()
    before = ledger.counters()
    pools = [f"rchurn{i}" for i in range(4)]
    recorded: dict[tuple[int, int], bytes] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    started = time.monotonic()
    with HostPoolManager() as manager:
        allocators = [
            manager.allocator(pool, KINDS[i % 3], populate="none" if i % 2 else "auto")
            for i, pool in enumerate(pools)
        ]

        def work(seed: int) -> None:
            rng = random.Random(seed)
            views: list[torch.Tensor] = []
            try:
                for _ in range(CYCLES // THREADS):
                    alloc = rng.choice(allocators)
                    # log-uniform 4 KiB .. 64 MiB; the large end is rare, as in a server
                    nbytes = int(math.exp(rng.uniform(math.log(4096), math.log(64 << 20))))
                    t, region = alloc._allocate((nbytes,), torch.uint8, "cpu")
                    if region.kind != "torch":
                        # A signature at the start tells a leaked region from a later,
                        # unrelated mapping that happens to get the same address range.
                        mark = SIGNATURE + region.id.to_bytes(8, "little")
                        t[:16].copy_(torch.frombuffer(bytearray(mark), dtype=torch.uint8))
                        with lock:
                            recorded[(region.address, region.address + region.mapped_bytes)] = mark
                    del region
                    roll = rng.random()
                    if roll < 0.5:
                        alloc.release(t)
                    elif roll < 0.7:
                        views.append(t[:64])  # a view kept past release
                        alloc.release(t)
                    # else dropped without release: the finalizer's job
                    del t
                    if len(views) > 16:
                        views.clear()
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
    seconds = time.monotonic() - started
    after = ledger.counters()

    def delta(key: str, label: str) -> int:
        return sum(after[key].get((p, label), 0) - before[key].get((p, label), 0) for p in pools)

    made = sum(delta("allocations_total", k) for k in ("shm", "mmap", "default"))
    assert made == CYCLES
    assert made == delta("releases_total", "explicit") + delta("releases_total", "finalizer")
    # Shared memfd regions show by name (the fixture checks /proc/self/maps for them);
    # anonymous ones by the signature at their start, whatever maps that address now.
    mem_fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        still = [span for span, mark in recorded.items() if still_marked(span[0], mark, mem_fd)]
    finally:
        os.close(mem_fd)
    assert still == []
    record_churn(CYCLES, seconds)
