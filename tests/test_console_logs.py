"""Console logs for people, JSON for tools, and a `serve --demo-load` whose info log does
not grow with its allocations."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from hostpool import HostPoolManager
from hostpool.cli.logsetup import for_people, format_seconds, is_byte_field, is_seconds_field
from hostpool.core.ledger_events import release_level
from tests import helpers, waiting

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("bytes", 67108864, "64MiB"),
        ("requested_bytes", 1536 << 20, "1.5GiB"),
        ("page_size", 4096, "4KiB"),
        ("done", 100, "100B"),
        ("rate_bytes_per_s", 512 << 20, "512MiB/s"),
        ("seconds", 0.000421, "421us"),
        ("seconds", 0.0123456, "12.3ms"),
        ("eta_s", 1.23456, "1.23s"),
        ("uptime_seconds", 187.4, "3m07s"),
        ("uptime_seconds", 7500.0, "2h05m"),
        ("pools", ["kv", "swa", "mamba"], "kv,swa,mamba"),
        ("hugepage_fallbacks", ("thp_disabled",), "thp_disabled"),
        ("releases", {"explicit": 3, "tensor": 1}, "explicit:3,tensor:1"),
        ("address", 0x7F0000001000, "0x7f0000001000"),
        ("fd", 7, 7),
        ("pool", "kv", "kv"),
        ("chunks", 3, 3),
    ],
)
def test_fields_for_people(key: str, value: object, shown: object) -> None:
    assert for_people(key, value) == shown


@pytest.mark.parametrize("value", [None, [], {}, ()])
def test_none_and_empty_fields_are_left_out(value: object) -> None:
    assert for_people("name", value) is None


def test_field_rules() -> None:
    assert is_byte_field("bytes") and is_byte_field("need_bytes") and is_byte_field("size")
    assert not is_byte_field("chunks") and not is_byte_field("rate_bytes_per_s")
    assert is_seconds_field("seconds") and is_seconds_field("eta_s")
    assert is_seconds_field("uptime_seconds") and not is_seconds_field("rate_bytes_per_s")
    assert format_seconds(0) == "0s" and format_seconds(42.4) == "42s"
    # A bool is not a byte count, a negative number is shown as it is.
    assert for_people("bytes", True) is True and for_people("bytes", -1) == -1


EMIT = """
from hostpool.cli.logsetup import configure_logging
from hostpool.base import events
configure_logging("info", "{fmt}")
events.info("hostpool.sample", bytes=67108864, pools=["kv", "swa"], fd=None,
            seconds=0.0123456, releases={{"explicit": 2}})
"""


def test_console_line_is_for_people() -> None:
    proc = helpers.run_python(EMIT.format(fmt="console"))
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "bytes=64MiB" in line and "pools=kv,swa" in line, line
    assert "seconds=12.3ms" in line and "releases=explicit:2" in line, line
    assert "fd=" not in line and "None" not in line and "[" not in line.split("]", 1)[1], line


def test_json_line_keeps_raw_values() -> None:
    proc = helpers.run_python(EMIT.format(fmt="json"))
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    event = json.loads(line)
    assert event["bytes"] == 67108864 and event["pools"] == ["kv", "swa"]
    assert event["fd"] is None and event["seconds"] == 0.0123456
    assert event["releases"] == {"explicit": 2}


def test_release_levels() -> None:
    assert release_level("explicit") == logging.DEBUG
    assert release_level("tensor") == logging.DEBUG
    assert release_level("finalizer") == logging.WARNING


def test_alloc_and_release_are_debug_and_close_sums_the_pool_up_at_info() -> None:
    with capture_logs() as logs:
        manager = HostPoolManager()
        alloc = manager.allocator("sumup_console")
        a = alloc.allocate((1 << 20,), torch.uint8)
        b = alloc.allocate((2 << 20,), torch.uint8)
        alloc.release(a)
        del a  # its last view: unmapped now
        kept = b[:10]  # a live view: close() leaves its region mapped, a leak
        del b
        manager.close()
    levels = {(e["event"], e["log_level"]) for e in logs if e.get("pool") == "sumup_console"}
    assert ("hostpool.alloc", "debug") in levels and ("hostpool.release", "debug") in levels
    assert ("hostpool.alloc", "info") not in levels
    assert ("hostpool.release", "info") not in levels
    (closed,) = [e for e in logs if e["event"] == "hostpool.pool_closed"]
    assert closed["log_level"] == "info" and closed["pool"] == "sumup_console"
    assert closed["allocations"] == 2 and closed["released_regions"] == 2
    assert closed["released_bytes"] == 3 << 20 and closed["releases"] == {"explicit": 2}
    assert closed["leaks"] == 1 and closed["leaked_bytes"] == 2 << 20
    del kept


def test_pool_closed_sums_up_its_own_manager_only() -> None:
    """A pool name used by an earlier manager of this process: the summary counts this
    manager's allocator alone, not the process's life under that name."""
    with HostPoolManager() as earlier:
        for _ in range(3):
            earlier.allocator("sumup_twice").allocate((1 << 20,), torch.uint8)
    with capture_logs() as logs, HostPoolManager() as manager:
        alloc = manager.allocator("sumup_twice")
        alloc.release(alloc.allocate((2 << 20,), torch.uint8))
    (closed,) = [e for e in logs if e["event"] == "hostpool.pool_closed"]
    assert closed["allocations"] == 1 and closed["allocated_bytes"] == 2 << 20
    assert closed["released_regions"] == 1 and closed["released_bytes"] == 2 << 20
    assert closed["releases"] == {"explicit": 1} and closed["leaks"] == 0


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and line.endswith("}"):
            out.append(json.loads(line))
    return out


def _demo_allocs(path: Path) -> int:
    return sum(
        1 for e in _events(path) if e["event"] == "hostpool.alloc" and e.get("pool") == "demo"
    )


def test_demo_load_info_log_does_not_grow_with_allocations(tmp_path: Path) -> None:
    """serve --demo-load at debug (JSON) for a fixed number of demo allocations; the lines
    an info log would show are those at info or above: none per normal allocation or
    release, only the demo's deliberate leaks and its provoked fallback and refusal."""
    wanted = 60  # demo allocations: several leak rounds (every 9th cycle) and one provoke
    err = tmp_path / "serve.err"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hostpool", "--log-format", "json", "--log-level", "debug",
             "serve", "--demo-load", "--port", "0"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=f,
        )  # fmt: skip
    try:
        waiting.wait_for(
            lambda: _demo_allocs(err) >= wanted, f"{wanted} demo allocations", alive=proc
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=waiting.DEADLINE) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = _events(err)
    names = [e["event"] for e in log]
    serving, stopping = names.index("hostpool.serving"), names.index("hostpool.serve_stopping")
    steady = log[serving + 1 : stopping]
    allocs = [e for e in steady if e["event"] == "hostpool.alloc"]
    releases = [e for e in steady if e["event"] == "hostpool.release"]
    assert len(allocs) >= wanted - 5 and releases, names
    assert {e["level"] for e in allocs} == {"debug"}
    for e in releases:
        assert e["level"] == ("warning" if e["how"] == "finalizer" else "debug"), e
    shown = [e for e in steady if e["level"] != "debug"]
    # What an info log shows while the demo runs: deliberate leaks and provoked events.
    allowed = {
        "hostpool.release",  # how=finalizer only (checked above)
        "hostpool.hugepage_fallback",
        "hostpool.alloc_failed",
        "hostpool.demo",
    }
    assert {e["event"] for e in shown} <= allowed, shown
    leaks = [e for e in releases if e["how"] == "finalizer"]
    assert leaks, names  # the demo's leak signal is still seen at info
    # One leak per 9 demo cycles (each ~1 allocation plus the leaked one) and a handful
    # of provoked lines: well under one info line per 4 allocations.
    assert 4 * len(shown) <= len(allocs), (len(shown), len(allocs))
    # Shutdown at info: one summary per pool, not one line per region.
    tail = [e for e in log[stopping:] if e["level"] != "debug"]
    closed = [e for e in tail if e["event"] == "hostpool.pool_closed"]
    assert {e["pool"] for e in closed} >= {"kv", "swa", "mamba", "demo"}
    assert len(closed) == len({e["pool"] for e in closed})
    assert {e["event"] for e in tail} <= {
        "hostpool.serve_stopping",
        "hostpool.pool_closed",
        "hostpool.serve_stopped",
        "hostpool.release",  # a leaked region collected during shutdown: finalizer
    }, tail
    kv = next(e for e in closed if e["pool"] == "kv")
    assert kv["released_bytes"] == 64 << 20 and kv["releases"] == {"explicit": 1}
