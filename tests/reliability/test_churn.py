"""Churn: many allocate/release cycles over threads, pools and every allocator type."""

from __future__ import annotations

import ctypes
import math
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


def anonymous_readable_ranges() -> list[tuple[int, int]]:
    """Readable anonymous mappings: reading any byte of them is safe (no file, no SIGBUS).
    Adjacent anonymous mappings merge into one line, so a region may sit inside one."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            path = fields[5] if len(fields) > 5 else ""
            plain = path in ("", "[heap]") or path.startswith("[anon")  # not [vvar] & co.
            if fields[1].startswith("r") and fields[4] == "0" and plain:
                lo, hi = fields[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


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
    # anonymous ones by the signature at their start, wherever a mapping now covers it.
    spans = anonymous_readable_ranges()
    still = [
        (start, end)
        for (start, end), mark in recorded.items()
        if any(lo <= start and start + len(mark) <= hi for lo, hi in spans)
        and ctypes.string_at(start, len(mark)) == mark
    ]
    assert still == []
    record_churn(CYCLES, seconds)
