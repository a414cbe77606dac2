"""Churn: many allocate/release cycles over threads, pools and every allocator type."""

from __future__ import annotations

import math
import random
import threading
import time

import torch

from hostpool import HostPoolManager
from hostpool.lifecycle import get_ledger
from tests import helpers
from tests.reliability.conftest import SOAK, record_churn

CYCLES = 100_000 if SOAK else 10_000
THREADS = 8
KINDS = ("shm", "mmap", "default")


def test_churn_counts_balance_and_nothing_is_left() -> None:
    ledger = get_ledger()
    before = ledger.counters()
    pools = [f"rchurn{i}" for i in range(4)]
    recorded: list[tuple[int, int]] = []
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
                        with lock:
                            recorded.append((region.address, region.address + region.mapped_bytes))
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
    candidates = {r for r in recorded if r[1] - r[0] != 1 << 20}  # CPython arenas are 1 MiB
    assert candidates & set(helpers.mapped_ranges()) == set()
    record_churn(CYCLES, seconds)
