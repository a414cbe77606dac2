"""prometheus_client's internals as `hostpool.metrics.promvalues` relies on them (the one
place that pins them): `values.ValueClass` is chosen when prometheus_client is imported,
writes the multiprocess files a server's `/metrics` reads, and says so by `_multiprocess`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hostpool.base.versiongate import distribution_version
from hostpool.metrics import promvalues

CHILD = r"""
import json, os, sys
from hostpool.base.versiongate import distribution_version
from hostpool.metrics import promvalues
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

out = {"writes_files": promvalues.writes_files(), "supported": promvalues.supported()}
if out["writes_files"]:
    g = promvalues.new_value("gauge", "livemax", "hp_probe", "hp_probe", ("pool",), ("a",),
                             "a probe gauge")
    g.set(7.5)
    c = promvalues.new_value("counter", "", "hp_calls", "hp_calls_total", (), (), "calls")
    c.set(3.0)
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    out["files"] = sorted(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
    out["samples"] = sorted(
        [s.name, s.labels, s.value, f.documentation]
        for f in registry.collect() for s in f.samples
    )
print(json.dumps(out))
"""


def _child(multiproc_dir: Path | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_the_installed_prometheus_client_is_one_it_was_read_from() -> None:
    assert promvalues.GATE.allows(distribution_version("prometheus_client"))


def test_values_write_the_files_multiprocess_mode_reads(tmp_path: Path) -> None:
    result = _child(tmp_path)
    assert result["supported"] is True and result["writes_files"] is True
    pid_files = result["files"]
    assert isinstance(pid_files, list) and len(pid_files) == 2
    assert {f.rsplit("_", 1)[0] for f in pid_files} == {"gauge_livemax", "counter"}
    assert result["samples"] == [
        ["hp_calls_total", {}, 3.0, "calls"],
        ["hp_probe", {"pool": "a"}, 7.5, "a probe gauge"],
    ]


def test_without_the_directory_values_stay_in_memory() -> None:
    assert _child(None)["writes_files"] is False
