"""Figures from the /proc readers' attack tests, for the README (bench/report_tables.py).

Written to bench/results/procfs-attacks.json under `make soak` (HOSTPOOL_SOAK=1) or
HOSTPOOL_RECORD_RESULTS=1; each test merges its own entry, so running one test updates
one figure.
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
PATH = Path(__file__).resolve().parents[2] / "bench" / "results" / "procfs-attacks.json"


def record(attack: str, **figures: Any) -> None:
    """Store `figures` for `attack` (a short name) with the date and kernel."""
    if not RECORD:
        return
    data: dict[str, Any] = json.loads(PATH.read_text()) if PATH.exists() else {}
    data["benchmark"] = "procfs-attacks"
    data["kernel"] = platform.release()
    data.setdefault("attacks", {})[attack] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **figures,
    }
    PATH.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
