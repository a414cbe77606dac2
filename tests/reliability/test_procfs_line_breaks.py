"""Names with line-break characters: the kernel writes a memfd's name into maps as it is
(a `\\n` as `\\012`, nothing else escaped) and into its fd's link with the `\\n` itself.
`str.splitlines()` ends lines at `\\r \\x0b \\x0c \\x1c-\\x1e \\x85 \\u2028 \\u2029` too:
a name could forge a whole 1 GiB mapping of pool `kv` in `hostpool inspect`. Both readers
(inspect's, and the exporter's C loops with either fd strategy) split at `\\n` only and
agree on every object, whatever its name holds."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from hostpool.proc import procfs, procgroup, scan
from tests import helpers
from tests.exporting import running_exporter, scrape, value

PAGE = mmap.PAGESIZE
GiB = 1 << 30
# what splitlines() (str or bytes) takes for a line end, and the kernel writes raw
BREAKS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
# the kernel ends the line with " (deleted)": the forged line gets it
FORGED = "7f0000000000-7f0040000000 rw-s 00000000 00:01 4242 /memfd:hostpool.kv.1.0"

# maps every name given (one page each, or 4 of 7 pages written through the fd) and keeps
# every fd; prints "ready"
HOLDER = """
import json, mmap, os, sys
names, pages = json.loads(sys.argv[1]), int(sys.argv[2])
keep = []
for name in names:
    fd = os.memfd_create(name.replace("PID", str(os.getpid())))
    if pages == 1:
        os.ftruncate(fd, mmap.PAGESIZE)
    else:  # pages written through the fd, never touched through the mapping (Rss 0)
        os.pwrite(fd, b"x" * (7 * mmap.PAGESIZE), 0)
    keep.append((fd, mmap.mmap(fd, pages * mmap.PAGESIZE)))
print("ready", flush=True)
sys.stdin.read()
"""


def holder(names: list[str], pages: int) -> Iterator[subprocess.Popen[str]]:
    proc = helpers.python_child(HOLDER, json.dumps(names), str(pages))
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def inspect_json(pid: int) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-m", "hostpool", "inspect", str(pid), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    doc: dict[str, object] = json.loads(result.stdout)
    return doc


@pytest.fixture
def forger() -> Iterator[subprocess.Popen[str]]:
    yield from holder([f"hostpool.x{brk}{FORGED}" for brk in BREAKS], 1)


def test_a_name_cannot_forge_a_mapping_in_inspect(forger: subprocess.Popen[str]) -> None:
    doc = inspect_json(forger.pid)
    pools = {(p["prefix"], p["pool"]): p for p in doc["pools"]}  # type: ignore[attr-defined]
    assert list(pools) == [("hostpool.", "-")]  # no pool "kv"
    (pool,) = pools.values()
    assert (pool["objects"], pool["mappings"]) == (len(BREAKS), len(BREAKS))
    assert pool["mapped_bytes"] == len(BREAKS) * PAGE  # not 1 GiB more
    names = sorted(o["name"] for o in doc["objects"])  # type: ignore[attr-defined]
    assert names == sorted(f"hostpool.x{brk}{FORGED}" for brk in BREAKS)
    # the detailed reader and the leak check's line reader, directly
    mappings = procgroup.shm_mappings(forger.pid)
    assert len(mappings) == len(BREAKS) and {m.name.pool for m in mappings} == {"-"}
    assert {m.name.pool for m in procgroup.shm_mappings(forger.pid, usage=True)} == {"-"}
    assert len(procfs.shm_maps_lines(forger.pid)) == len(BREAKS)


def test_the_exporter_sees_no_forged_mapping_either(forger: subprocess.Popen[str]) -> None:
    with running_exporter("--pid", str(forger.pid)) as exporter:
        _, samples = scrape(exporter.url)
        exporter.stop()
    assert value(samples, "hostpool_exporter_mapped_bytes", prefix="hostpool.", pool="-") == (
        len(BREAKS) * PAGE
    )
    pools = {dict(labels)["pool"] for name, labels in samples if "pool" in dict(labels)}
    assert pools == {"-"}


# a name per break character, and one per character that ends the name's pid (so the
# name's pool stays parseable only where the kernel spells it the same way in both)
AGREE = [f"hostpool.kv{i}.PID.{i}{brk}tail" for i, brk in enumerate(["\n", *BREAKS])]
AGREE += ["hostpool.plain.PID.0", "hostpool.kvx.PID.1\\012tail"]  # a literal backslash


@pytest.fixture
def agreeing() -> Iterator[subprocess.Popen[str]]:
    yield from holder(AGREE, 4)


def _expected(pid: int) -> set[str]:
    return {name.replace("PID", str(pid)) for name in AGREE}


@pytest.mark.parametrize("fds_by", ["stat", "link", "auto"])
def test_both_readers_agree_on_names_with_line_breaks(
    agreeing: subprocess.Popen[str], fds_by: scan.FdStrategy
) -> None:
    doc = inspect_json(agreeing.pid)
    objects = doc["objects"]
    assert {o["name"] for o in objects} == _expected(agreeing.pid)  # type: ignore[attr-defined]
    detailed = {
        (p["prefix"], p["pool"]): (p["open_fds"], p["mappings"], p["mapped_bytes"])
        for p in doc["pools"]  # type: ignore[attr-defined]
    }
    matcher = scan.Matcher(("hostpool.",))
    holdings = scan.read_holdings(agreeing.pid, matcher, fds_by=fds_by)
    assert holdings.complete and scan.fill_residency(holdings, matcher, {}, smaps=False)
    totals = procgroup.holdings_totals(holdings)
    got = {pool: (t.open_fds, t.mappings, t.mapped_bytes) for pool, t in totals.items()}
    assert got == detailed
    # each object: its fd and mmap's dup, one mapping of 4 pages, holding 4 of its 7 pages
    # through the mapping whichever way its fds were read (by_link once took a name with a
    # newline for another object: its pages then came from smaps, 0)
    n = len(AGREE) - 1  # all but "plain" have no pool the name can say
    assert got[("hostpool.", "-")] == (2 * n, n, n * 4 * PAGE)
    assert got[("hostpool.", "plain")] == (2, 1, 4 * PAGE)
    assert {pool: t.resident_bytes for pool, t in totals.items()} == {
        pool: t[2] for pool, t in got.items()
    }
    assert all(row[scan.ROW_FDS] == 2 for row in holdings.rows.values())
    assert not holdings.unmapped_fds


def test_the_exporter_agrees_with_inspect(agreeing: subprocess.Popen[str]) -> None:
    doc = inspect_json(agreeing.pid)
    with running_exporter("--pid", str(agreeing.pid)) as exporter:
        _, samples = scrape(exporter.url)
        exporter.stop()
    for p in doc["pools"]:  # type: ignore[attr-defined]
        labels = {"prefix": p["prefix"], "pool": p["pool"]}
        assert value(samples, "hostpool_exporter_open_fds", **labels) == p["open_fds"]
        assert value(samples, "hostpool_exporter_mappings", **labels) == p["mappings"]
        assert value(samples, "hostpool_exporter_mapped_bytes", **labels) == p["mapped_bytes"]
        assert value(samples, "hostpool_exporter_resident_bytes", **labels) == p["mapped_bytes"]


def test_a_cgroup_named_with_line_breaks_is_read_as_one_line(root: None) -> None:
    """/proc/self/cgroup writes a cgroup's name as it is: a process in a cgroup named
    with `\\x0b`, `\\x85` or `\\r` (a delegated cgroup's owner picks its name) reads its
    own limit, where splitlines() once made a line of the name's tail and failed."""
    with helpers.memory_cgroup("hostpool-t\x0bx:y\x85z\rw", 512 << 20) as group:
        procs = os.path.join(group, "cgroup.procs")
        code = (
            "import os\n"
            "from hostpool.memory import cgroup\n"
            f"open({procs!r}, 'w').write(str(os.getpid()))\n"
            "limit = cgroup.memory_limit()\n"
            "print(limit.limit if limit else None)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert int(result.stdout) <= 512 << 20
