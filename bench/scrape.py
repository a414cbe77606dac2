"""Cost of a scrape as live allocations grow, next to a bare fstat loop over the same fds.

For 10, 100, 1,000 and 5,000 live 4 KiB shm allocations (soft RLIMIT_NOFILE raised to
the hard one: each region holds its fd and mmap's dup), times HostPoolCollector.collect()
and, in the same run, `os.fstat` over every region fd. The marginal cost per allocation
is the slope from 1,000 to 5,000; the fixed cost is the intercept. Anonymous regions
(measured with mincore instead of fstat) are reported separately.
Writes bench/results/scrape.json.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import other_cpu
from hostpool import HostPoolManager
from hostpool.metrics import HostPoolCollector

RESULTS = Path(__file__).resolve().parent / "results" / "scrape.json"
COUNTS = (10, 100, 1000, 5000)
TARGET = 3.0


def timed(fn: Any, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def series(kind: str) -> list[dict[str, float]]:
    rows = []
    with HostPoolManager() as manager:
        alloc = manager.allocator(f"scrape_{kind}", kind)
        tensors: list[torch.Tensor] = []
        collector = HostPoolCollector()
        for count in COUNTS:
            while len(tensors) < count:
                tensors.append(alloc.allocate((4096,), torch.uint8))
            fds = [r.fd for r in alloc.regions if r.fd is not None]
            with other_cpu() as load:
                collect = timed(lambda: list(collector.collect()), 15)
                fstat = timed(lambda fds=fds: [os.fstat(fd) for fd in fds], 15) if fds else 0.0
            rows.append(
                {
                    "allocations": count,
                    "collect_s": collect,
                    "fstat_loop_s": fstat,
                    "other_cpus": load["other_cpus"],
                }
            )
        alloc.close()
        del tensors
    return rows


def slope(rows: list[dict[str, float]], key: str) -> tuple[float, float]:
    a, b = rows[-2], rows[-1]
    per = (b[key] - a[key]) / (b["allocations"] - a["allocations"])
    return per, a[key] - per * a["allocations"]


def main() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    shm = series("shm")
    anon = series("mmap")
    per_alloc, fixed = slope(shm, "collect_s")
    per_fd, _ = slope(shm, "fstat_loop_s")
    anon_per, anon_fixed = slope(anon, "collect_s")
    ratio = per_alloc / per_fd
    result = {
        "benchmark": "scrape",
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nofile": {"soft_before": soft, "hard": hard},
        "shm": shm,
        "anon": anon,
        "per_allocation_s": per_alloc,
        "fixed_s": fixed,
        "per_fstat_s": per_fd,
        "ratio_to_fstat": ratio,
        "anon_per_allocation_s": anon_per,
        "anon_fixed_s": anon_fixed,
        "target_ratio": TARGET,
        "pass": ratio <= TARGET,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for row in shm:
        print(
            f"shm {row['allocations']:>5}: collect {row['collect_s'] * 1e3:8.2f} ms, "
            f"fstat loop {row['fstat_loop_s'] * 1e3:7.2f} ms"
        )
    print(
        f"marginal {per_alloc * 1e6:.2f} us/allocation = {ratio:.2f}x fstat "
        f"({per_fd * 1e6:.2f} us; target <= {TARGET}x: {'pass' if result['pass'] else 'FAIL'}); "
        f"fixed {fixed * 1e3:.2f} ms; anon {anon_per * 1e6:.2f} us/allocation"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
