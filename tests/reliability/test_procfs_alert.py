"""The false alert, end to end: what a real `exporter --pid` serves for a healthy sglang
server (raw `sglang_host_pool_` memfds, no `hostpool.` one), then after it exited, fed
to the real alert rules with promtool: HostpoolExporterNoProcesses never fires, and
HostpoolExporterTargetGone fires only once the process is gone."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import helpers
from tests.exporting import Samples, running_exporter, scrape

ALERTS = Path(__file__).resolve().parents[2] / "metrics" / "alerts.yml"
SGLANG_SERVER = """
import mmap, os, sys
fd = os.memfd_create("sglang_host_pool_" + sys.argv[1], os.MFD_CLOEXEC)
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20)
print("ready", flush=True)
sys.stdin.read()
"""
RUNBOOK = "file:///opt/hostpool/docs/runbook.md#"
SUMMARY = "The process a hostpool exporter watches has exited."
MINUTES = 15  # each phase, longer than either alert's `for:`


def series(before: Samples, after: Samples) -> list[dict[str, str]]:
    """promtool input series: each sample's value for MINUTES, then its value after the
    exit (or `_`, absent, for MINUTES)."""
    out = []
    for key in sorted(set(before) | set(after), key=str):
        name, labels = key
        if name.endswith("_seconds"):
            continue  # timings say nothing to the rules
        selector = ", ".join(
            f'{k}="{v}"' for k, v in sorted({**dict(labels), "job": "x", "instance": "e"}.items())
        )
        first = f"{before[key]:g}x{MINUTES}" if key in before else f"_x{MINUTES}"
        second = f"{after[key]:g}x{MINUTES}" if key in after else f"_x{MINUTES}"
        out.append({"series": f"{name}{{{selector}}}", "values": f"{first} {second}"})
    return out


def none_at(eval_time: str, alert: str) -> dict[str, object]:
    return {"eval_time": eval_time, "alertname": alert, "exp_alerts": []}


def test_a_healthy_sglang_server_fires_no_exporter_alert(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make prometheus)")
    server = helpers.python_child(SGLANG_SERVER, secrets.token_hex(8))
    try:
        with running_exporter("--pid", str(server.pid)) as exporter:
            _, before = scrape(exporter.url)
            server.kill()
            server.wait()
            _, after = scrape(exporter.url)
            exporter.stop()
    finally:
        server.kill()
        server.wait()
    pid = str(server.pid)
    quiet = f"{MINUTES - 1}m"
    gone = f"{2 * MINUTES - 1}m"
    test = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series(before, after),
                "alert_rule_test": [
                    none_at(quiet, "HostpoolExporterNoProcesses"),
                    none_at(quiet, "HostpoolExporterTargetGone"),
                    none_at(gone, "HostpoolExporterNoProcesses"),
                    {
                        "eval_time": gone,
                        "alertname": "HostpoolExporterTargetGone",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "job": "x",
                                    "instance": "e",
                                    "pid": pid,
                                },
                                "exp_annotations": {
                                    "summary": SUMMARY,
                                    "description": (
                                        f"The exporter at e watches pid {pid}, which has not "
                                        "existed for 5 minutes: the server stopped or restarted "
                                        "under a new pid."
                                    ),
                                    "runbook_url": RUNBOOK + "hostpoolexportertargetgone",
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "exporter_alerts_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # what the exporter served: the sglang prefix's gauges and target_up, no processes gauge
    names = {name for name, _ in before}
    assert "hostpool_exporter_open_fds" in names and "hostpool_exporter_target_up" in names
    assert "hostpool_exporter_processes" not in names
