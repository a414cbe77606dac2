"""`ProcfsCollector.collect()` in this process: what a scrape does to the interpreter."""

from __future__ import annotations

import gc
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from hostpool.metrics.exporter import ProcfsCollector
from hostpool.proc import procgroup, scan
from tests import helpers

HOLDER = """
import mmap, os, sys
keep = []
for i in range(200):
    fd = os.memfd_create(f"{sys.argv[1]}kv.{os.getpid()}.{i}")
    os.ftruncate(fd, mmap.PAGESIZE)
    keep.append(mmap.mmap(fd, mmap.PAGESIZE))
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def collections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The generations of the collector's passes made while a scan reads a process's
    /proc files (`read_holdings`), with a threshold low enough that a few allocations
    start one."""
    seen: list[int] = []
    reading = [False]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and reading[0]:
            seen.append(info["generation"])

    def read_holdings(*args: Any, **kwargs: Any) -> scan.Holdings:
        reading[0] = True
        try:
            return scan.read_holdings(*args, **kwargs)
        finally:
            reading[0] = False

    monkeypatch.setattr(procgroup, "read_holdings", read_holdings)
    threshold = gc.get_threshold()
    gc.set_threshold(10)
    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)


def test_a_scrape_runs_without_collector_passes(collections: list[int]) -> None:
    prefix = f"hostpool.gc{secrets.token_hex(3)}_"
    proc = helpers.python_child(HOLDER, prefix)
    try:
        collector = ProcfsCollector(match=(prefix,), max_pools=4)
        assert gc.isenabled()
        procgroup.scan_totals(scan.Matcher((prefix,)))  # the same reading, not paused
        assert collections, "the check sees no passes: the reading made none"
        collections.clear()
        families = {f.name: f for f in collector.collect()}
        assert collections == []
        assert gc.isenabled()  # back on once the scrape is over
        (fds,) = families["hostpool_exporter_open_fds"].samples
        assert fds.value == 400  # the scrape did read: each memfd's fd and mmap's dup
        gc.disable()  # a collector turned off by the application stays off
        try:
            collector.collect()
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        proc.kill()
        proc.wait()
