"""The broker's benchmark section (bench/report_broker.py): every figure and the verdict
come from the results file, a missed target reads as a failure, and the engine restarts
appear only where the run measured them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import RENDERERS, Context

CTX = Context(results_dir=Path("/nonexistent"), page=None, charts=False)
MACHINE = {"kernel": "6.1.0-test", "cpus": 3, "python": "3.11.0", "torch": "2.0"}


def restart_data(lease_s: float, *, engine: bool) -> dict[str, Any]:
    populate_s = 2.5
    data: dict[str, Any] = {
        "date": "2031-02-03T04:05:06Z",
        "machine": MACHINE,
        "attach_vs_populate": {
            "bytes": 8 << 30,
            "populate_s": populate_s,
            "lease_s": lease_s,
            "lease_and_prefault_s": 0.75,
            "lease_share_of_populate": lease_s / populate_s,
            "lease_and_prefault_share_of_populate": 0.3,
            "target_share": 0.05,
            "meets_target": lease_s / populate_s <= 0.05,
            "rounds": [{"lease_s": lease_s}] * 3,
            "other_cpus": 0.03,
        },
    }
    if engine:
        data["engine_restart"] = [
            {"broker": True, "restart_to_first_token_s": 21.25, "prefix_tokens": 384,
             "prefix_tokens_from_host_tier": 384.0, "other_cpus": 0.05},
            {"broker": False, "restart_to_first_token_s": 27.5, "prefix_tokens": 384,
             "prefix_tokens_from_host_tier": 0.0, "other_cpus": 0.04},
        ]  # fmt: skip
    return data


def test_the_figures_and_the_verdict_come_from_the_file() -> None:
    text = RENDERERS["broker_restart"](restart_data(0.0021, engine=True), CTX)
    assert "A populated 8 GiB broker pool" in text
    assert "| 2.50 s | 2.1 ms | 0.08% | pass | 750.0 ms | 30.0% |" in text
    assert "| yes | 21.2 s | 384 / 384 | 0.05 |" in text
    assert "| no (the stock spec) | 27.5 s | 0 / 384 | 0.04 |" in text
    assert "median of 3 lessees" in text


def test_a_missed_target_fails_and_no_engine_rows_without_a_run() -> None:
    text = RENDERERS["broker_restart"](restart_data(0.5, engine=False), CTX)
    assert "| 20.00% | **fail** |" in text
    assert "first token" not in text
