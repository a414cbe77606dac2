"""Figures that reliability tests write for docs/testing.md (rendered by bench/report.py).

Written to bench/results/<benchmark>.json under `make soak` (HOSTPOOL_SOAK=1) or
HOSTPOOL_RECORD_RESULTS=1; each call merges one entry, so running one test updates one
figure and leaves the others. Each entry carries the CPU other processes used while its
test ran (`other_cpus`, bench/_common's meter, started per test by the conftest), so
bench/report.py marks a figure measured under load as the benches' own.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench._common import LoadMeter

SOAK = os.environ.get("HOSTPOOL_SOAK") == "1"
RECORD = SOAK or os.environ.get("HOSTPOOL_RECORD_RESULTS") == "1"
RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"

_test_meter: LoadMeter | None = None


def start_test() -> None:
    """The current test starts: what other processes do from now is its load."""
    global _test_meter
    _test_meter = LoadMeter() if RECORD else None


def record(benchmark: str, section: str, key: str, **figures: Any) -> None:
    """Store `figures` as `<section>.<key>` of bench/results/<benchmark>.json, with the
    date and the other processes' CPU since the test started; the file also names the
    kernel."""
    if not RECORD:
        return
    if _test_meter is None:
        raise RuntimeError("results.record() outside a test that started a meter")
    path = RESULTS_DIR / f"{benchmark}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    data["benchmark"] = benchmark
    data["kernel"] = platform.release()
    data.setdefault(section, {})[key] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "other_cpus": round(_test_meter.read()["other_cpus"], 3),
        **figures,
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def record_procfs_attack(attack: str, **figures: Any) -> None:
    """One attack of tests/reliability/test_procfs_*.py (bench/results/procfs-attacks.json)."""
    record("procfs-attacks", "attacks", attack, **figures)
