"""Figures that reliability tests write for docs/testing.md (rendered by bench/report.py).

Written to bench/results/<benchmark>.json under `make soak` (HOSTPOOL_SOAK=1) or
HOSTPOOL_RECORD_RESULTS=1; each call merges one entry, so running one test updates one
figure and leaves the others.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

SOAK = os.environ.get("HOSTPOOL_SOAK") == "1"
RECORD = SOAK or os.environ.get("HOSTPOOL_RECORD_RESULTS") == "1"
RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"


def record(benchmark: str, section: str, key: str, **figures: Any) -> None:
    """Store `figures` as `<section>.<key>` of bench/results/<benchmark>.json, with the
    date; the file also names the kernel."""
    if not RECORD:
        return
    path = RESULTS_DIR / f"{benchmark}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    data["benchmark"] = benchmark
    data["kernel"] = platform.release()
    data.setdefault(section, {})[key] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **figures,
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def record_procfs_attack(attack: str, **figures: Any) -> None:
    """One attack of tests/reliability/test_procfs_*.py (bench/results/procfs-attacks.json)."""
    record("procfs-attacks", "attacks", attack, **figures)
