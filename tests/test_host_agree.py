"""One reader, one room (issue host-truth, item 6): `hostpool inspect --json`, the
exporter's per-pool series and `hostpool shm --json` agree on every object they all see,
and a name that would be a maps line of its own if split on a control character other
than `\\n` forges nothing in any of them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hostpool.metrics.exporter import ProcfsCollector
from tests import helpers

ROOT = Path(__file__).resolve().parent.parent
FORGED = "7f0000000000-7f0000400000 rw-s 00000000 00:01 4242 /memfd:hostpool.forged.1.1 (deleted)"

# hostpool memfds (size i+2 pages, i+1 written through the mapping: resident below size),
# an sglang raw one, and one whose name carries a forged maps line after \x1c
HOLDER = r"""
import mmap, os, sys
page, keep = mmap.PAGESIZE, []
def make(name, pages, written):
    fd = os.memfd_create(name)
    os.ftruncate(fd, pages * page)
    m = mmap.mmap(fd, pages * page)
    m[: written * page] = b"x" * (written * page)
    keep.append(m)
for i in range(5):
    make(f"hostpool.agree.{os.getpid()}.{i}", i + 2, i + 1)
make("sglang_host_pool_0123456789abcdef", 3, 2)
make(f"hostpool.agree.{os.getpid()}.9\x1c" + sys.argv[1], 2, 1)
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def holder() -> Iterator[int]:
    proc = helpers.python_child(HOLDER, FORGED)
    try:
        yield proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)


def hostpool_json(*args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "hostpool", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=True,
    )
    return json.loads(out.stdout)


def test_inspect_the_exporter_and_shm_agree(root: None, holder: int) -> None:
    inspected = hostpool_json("inspect", str(holder))
    shm = hostpool_json("shm")
    series: dict[tuple[str, str], dict[str, float]] = {}
    for family in ProcfsCollector(pid=holder, max_pools=8).collect():
        for s in family.samples:
            if "pool" in s.labels:
                series.setdefault((s.labels["prefix"], s.labels["pool"]), {})[s.name] = s.value

    # per object: inspect and shm
    seen_by_inspect = {
        o["name"]: (
            o["size"],
            len(o["fds"]),
            len(o["mappings"]),
            sum(m["resident_bytes"] for m in o["mappings"]),
        )
        for o in inspected["objects"]
    }
    seen_by_shm = {}
    for o in shm["objects"]:
        mine = [h for h in o["holders"] if h["pid"] == holder]
        if mine and o["engine"] in ("hostpool", "sglang"):
            seen_by_shm[o["name"]] = (o["size_bytes"], mine[0]["fds"], mine[0]["mappings"],
                                      o["resident_bytes"])  # fmt: skip
    assert len(seen_by_shm) == 7
    assert seen_by_inspect == seen_by_shm
    assert all(resident < size for size, _fds, _maps, resident in seen_by_shm.values())

    # per pool: the exporter's series are the sums of shm's objects
    pools: dict[tuple[str, str], list[int]] = {}
    for o in shm["objects"]:
        for h in o["holders"]:
            if h["pid"] == holder and o["engine"] in ("hostpool", "sglang"):
                prefix = "hostpool." if o["engine"] == "hostpool" else "sglang_host_pool_"
                sums = pools.setdefault((prefix, o["pool"] or "-"), [0, 0, 0])
                sums[0] += h["fds"]
                sums[1] += h["mappings"]
                sums[2] += o["resident_bytes"]
    exported = {
        pool: [
            int(v["hostpool_exporter_open_fds"]),
            int(v["hostpool_exporter_mappings"]),
            int(v["hostpool_exporter_resident_bytes"]),
        ]
        for pool, v in series.items()
    }
    assert exported == pools
    assert set(pools) == {("hostpool.", "agree"), ("hostpool.", "-"), ("sglang_host_pool_", "-")}

    # nobody forged an object out of the \x1c name
    for names in (seen_by_inspect, seen_by_shm, {p for _, p in series}):
        assert not any("forged" in n and not n.startswith("hostpool.agree.") for n in names)
    assert not any(o["name"] == "hostpool.forged.1.1" for o in shm["objects"])
