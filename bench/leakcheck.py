"""Cost of the pytest leak check per clean test, next to the bare /proc reads it needs.

One in-process pytest session per fd count (10 and 1,000 open fds: dummy fds are opened
to reach the count) runs rounds of three clean tests, in rotating order so drift hits
all alike:
  off:   no check (the plugin's autouse fixture sees no marker and returns);
  on:    `@pytest.mark.hostpool_leak_check`;
  reads: no check; the body times the bare reads the check cannot avoid: two passes of
         listdir + readlink over /proc/self/fd and two reads of /proc/self/maps.
Each test's whole protocol (setup, call, teardown) is timed by a hook. The overhead is
the median of paired differences on - off; the target is overhead <= 1.3x the median
bare reads. torch is imported first so /proc/self/maps is as long as in a real suite.
Writes bench/results/leakcheck.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import other_cpu

RESULTS = Path(__file__).resolve().parent / "results" / "leakcheck.json"
TARGET_RATIO = 1.3
KINDS = ("off", "on", "reads")

TEST_MODULE = """
import os, time
import pytest

READS = []

def bare_reads():
    t0 = time.perf_counter()
    for _ in range(2):
        for name in os.listdir("/proc/self/fd"):
            try:
                os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                pass
        with open("/proc/self/maps") as f:
            f.read()
    READS.append(time.perf_counter() - t0)
"""

BODIES = {
    "off": "def test_{i:05d}_off():\n    pass\n",
    "on": "@pytest.mark.hostpool_leak_check\ndef test_{i:05d}_on():\n    pass\n",
    "reads": "def test_{i:05d}_reads():\n    bare_reads()\n",
}


class ProtocolTimer:
    """Times each test's full runtest protocol (setup + call + teardown + reports)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {k: [] for k in KINDS}

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        t0 = time.perf_counter()
        result = yield
        self.seconds[item.name.rsplit("_", 1)[1]].append(time.perf_counter() - t0)
        return result


def open_fds_to(count: int) -> list[int]:
    have = len(os.listdir("/proc/self/fd")) - 1  # minus the listdir's own fd
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(max(0, count - have))]


def run_case(fd_count: int, rounds: int, workdir: Path) -> dict[str, Any]:
    extra = open_fds_to(fd_count)
    try:
        open_fds = len(os.listdir("/proc/self/fd")) - 1
        with open("/proc/self/maps") as f:
            maps_lines = sum(1 for _ in f)
        rng = random.Random(fd_count)
        parts = [TEST_MODULE]
        for i in range(rounds):
            order = list(KINDS)
            rng.shuffle(order)
            parts += [BODIES[k].format(i=i) for k in order]
        path = workdir / f"test_leakcheck_{fd_count}.py"
        path.write_text("\n".join(parts))
        timer = ProtocolTimer()
        with other_cpu() as load:
            code = pytest.main(
                [str(path), "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                 "--rootdir", str(workdir)],
                plugins=[timer],
            )  # fmt: skip
        if code != 0:
            raise SystemExit(f"the benchmark's pytest session failed ({code})")
        reads = sys.modules[path.stem].READS
        del sys.modules[path.stem]
    finally:
        for fd in extra:
            os.close(fd)
    t = timer.seconds
    overhead = [b - a for a, b in zip(t["off"], t["on"], strict=True)]
    reads_cost = [b - a for a, b in zip(t["off"], t["reads"], strict=True)]
    ratio = statistics.median(overhead) / statistics.median(reads)
    return {
        "open_fds": open_fds,
        "maps_lines": maps_lines,
        "rounds": rounds,
        "test_off_us": median_us(t["off"]),
        "test_on_us": median_us(t["on"]),
        "overhead_us": median_us(overhead),
        "overhead_ci95_us": ci95_us(overhead),
        "bare_reads_us": median_us(reads),
        "bare_reads_ci95_us": ci95_us(reads),
        "reads_test_minus_off_us": median_us(reads_cost),
        "ratio": ratio,
        "pass": ratio <= TARGET_RATIO,
        "other_cpus": load["other_cpus"],
    }


def median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def ci95_us(values: list[float], rounds: int = 2000) -> list[float]:
    """Bootstrap 95% interval of the median."""
    rng = random.Random(1)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return [medians[int(0.025 * rounds)] * 1e6, medians[int(0.975 * rounds) - 1] * 1e6]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000, help="tests of each kind per case")
    parser.add_argument("--rounds-1000", type=int, default=300, help="rounds at 1,000 fds")
    parser.add_argument("--no-torch", action="store_true", help="do not import torch first")
    args = parser.parse_args()
    torch_version = None
    if not args.no_torch:
        import torch

        torch_version = torch.__version__
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            run_case(10, args.rounds, Path(tmp)),
            run_case(1000, args.rounds_1000, Path(tmp)),
        ]
    result = {
        "benchmark": "leakcheck",
        "machine": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "pytest": pytest.__version__,
            "torch": torch_version,
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": "in-process pytest, rotating off/on/reads rounds, medians of paired "
        "per-test protocol times; bare reads timed inside the reads test",
        "target_ratio": TARGET_RATIO,
        "cases": cases,
        "pass": all(c["pass"] for c in cases),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for c in cases:
        print(
            f"{c['open_fds']:5d} fds, {c['maps_lines']} maps lines: check {c['overhead_us']:.0f} us"
            f" per test, bare reads {c['bare_reads_us']:.0f} us, ratio {c['ratio']:.2f}"
            f" ({'pass' if c['pass'] else 'FAIL'})",
            file=sys.stderr,
        )
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
