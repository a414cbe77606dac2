"""Every reliability test must leave the process as it found it: hostpool fds, mappings,
the ledger, and the shared memory this process and its children hold within 16 MiB of its
baseline (never the host's Shmem, which other processes move)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

from bench._common import LoadMeter
from hostpool.core.ledger import get_ledger
from tests import helpers
from tests.reliability import results

SOAK = os.environ.get("HOSTPOOL_SOAK") == "1"
SHMEM_SLACK = 16 << 20


@pytest.fixture(autouse=True)
def back_to_baseline() -> Iterator[None]:
    ledger = get_ledger()
    gc.collect()
    ledger.drain()
    fds = helpers.fd_links()
    maps = helpers.maps_lines("hostpool.")
    ids = {r.id for r in ledger.snapshot()}
    shmem = helpers.tree_shmem_bytes()
    results.start_test()
    yield
    gc.collect()
    ledger.drain()
    assert helpers.fd_links() == fds
    assert helpers.maps_lines("hostpool.") == maps
    assert {r.id for r in ledger.snapshot()} == ids
    assert helpers.tree_shmem_bytes() <= shmem + SHMEM_SLACK


_results: dict[str, object] = {"passed": [], "failed": []}
_session_meter: LoadMeter | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _session_meter
    _session_meter = LoadMeter() if SOAK else None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        key = "passed" if report.passed else "failed"
        _results[key].append(report.nodeid)  # type: ignore[attr-defined]


def record_churn(cycles: int, seconds: float, **figures: object) -> None:
    _results["churn"] = {"cycles": cycles, "seconds": round(seconds, 1), **figures}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """`make soak` writes its figures for docs/testing.md (bench/report.py renders them)."""
    if not SOAK:
        return
    import json
    import platform
    import time
    from pathlib import Path

    passed: list[str] = _results["passed"]  # type: ignore[assignment]
    faults = [t for t in passed if "/test_faults.py" in t or "/test_kills.py" in t]
    out = {
        "benchmark": "soak",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kernel": platform.release(),
        "churn": _results.get("churn"),
        "tests_passed": len(passed),
        "tests_failed": len(_results["failed"]),  # type: ignore[arg-type]
        "faults_injected": len(faults),
        "fault_cases": sorted(t.split("::")[-1] for t in faults),
        # other processes' CPU over the whole run: the churn's figures are timings
        "other_cpus": round(_session_meter.read()["other_cpus"], 3) if _session_meter else None,
    }
    path = Path(__file__).resolve().parents[2] / "bench" / "results" / "soak.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
