"""The exporter's memory when holders make new memfds with new names before every scrape
(memfd names cannot be changed: "renaming" is closing them and making others). The
parsed-path cache keeps what the last scan met, so memory stays within twice its steady
size however many scrapes see new names (it once kept 16 scans' worth: 8x and more).

Test scale here (in-process, Python allocations traced); the real scale, 95,000 memfds
and the exporter's resident set, is the slow test below."""

from __future__ import annotations

import re
import resource
import secrets
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hostpool.metrics.exporter import ProcfsCollector
from tests.exporting import running_exporter, scrape, value
from tests.reliability.results import record_procfs_attack as record

# each line on stdin: close every memfd held and make COUNT new ones with names never
# used before (mapped, one page each, held by mmap's fd only); prints "ready" when held
RENAMER = """
import mmap, os, sys
prefix, count = sys.argv[1], int(sys.argv[2])
held, made = [], 0
for _ in sys.stdin:
    for mm in held:
        mm.close()
    held = []
    for _ in range(count):
        fd = os.memfd_create(f"{prefix}kv{made % 4}.{os.getpid()}.{made}", os.MFD_CLOEXEC)
        os.ftruncate(fd, mmap.PAGESIZE)
        held.append(mmap.mmap(fd, mmap.PAGESIZE))
        os.close(fd)  # mmap keeps a dup of its own
        made += 1
    print("ready", flush=True)
"""


class Renamers:
    """Processes holding `count` memfds each, renewed (new names) on `renew()`."""

    def __init__(self, prefix: str, processes: int, count: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        for _ in range(processes):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", RENAMER, prefix, str(count)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    preexec_fn=_raise_nofile,
                )
            )
        self.renew()

    def renew(self) -> None:
        for proc in self.procs:  # all at once, then wait for each
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        for proc in self.procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"

    def close(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in self.procs:
            proc.wait(timeout=120)


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@contextmanager
def renamers(prefix: str, processes: int, count: int) -> Iterator[Renamers]:
    held = Renamers(prefix, processes, count)
    try:
        yield held
    finally:
        held.close()


STEADY_SCRAPES = 4
RENAMED_SCRAPES = 20  # past the 16 scans the cache once kept


def test_new_names_before_every_scrape_keep_memory_bounded() -> None:
    prefix = f"hostpool.mem{secrets.token_hex(3)}"
    count = 6000
    collector = ProcfsCollector(match=(prefix,), max_pools=32)
    with renamers(prefix, 1, count) as held:
        tracemalloc.start()
        try:
            steady_kept, steady_peak = 0, 0
            for _ in range(STEADY_SCRAPES):  # the same names: the steady size
                tracemalloc.reset_peak()
                families = list(collector.collect())
                kept, peak = tracemalloc.get_traced_memory()
                steady_kept, steady_peak = max(steady_kept, kept), max(steady_peak, peak)
            assert _fds(families, prefix) == count
            kept_at, peak_at = [], []
            for _ in range(RENAMED_SCRAPES):
                held.renew()
                tracemalloc.reset_peak()
                families = list(collector.collect())
                kept, peak = tracemalloc.get_traced_memory()
                kept_at.append(kept)
                peak_at.append(peak)
                assert _fds(families, prefix) == count
            del families
        finally:
            tracemalloc.stop()
    assert max(kept_at) <= 2 * steady_kept, (steady_kept, kept_at)
    assert max(peak_at) <= 2 * steady_peak, (steady_peak, peak_at)


def _fds(families: list[object], prefix: str) -> float:
    return sum(
        s.value
        for f in families
        if getattr(f, "name", "") == "hostpool_exporter_open_fds"
        for s in f.samples  # type: ignore[attr-defined]
        if s.labels["prefix"] == prefix
    )


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        match = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None
    return int(match[1]) * 1024


@pytest.mark.slow
def test_at_scale_95000_renamed_memfds_keep_the_exporter_within_twice_its_size() -> None:
    """The real exporter, 5 processes x 19,000 memfds named anew before every scrape."""
    prefix = f"hostpool.mem{secrets.token_hex(3)}"
    processes, count = 5, 19_000
    with (
        renamers(prefix, processes, count) as held,
        running_exporter("--match", prefix, "--scrape-budget", "60") as exporter,
    ):
        pid = exporter.proc.pid
        steady = 0
        for _ in range(STEADY_SCRAPES):
            _, samples = scrape(exporter.url, timeout=120)
            steady = max(steady, _rss(pid))
        sizes = []
        for _ in range(RENAMED_SCRAPES):
            held.renew()
            _, samples = scrape(exporter.url, timeout=120)
            assert value(samples, "hostpool_exporter_scrape_truncated") == 0
            fds = sum(v for (name, labels), v in samples.items()
                      if name == "hostpool_exporter_open_fds")  # fmt: skip
            assert fds == processes * count
            sizes.append(_rss(pid))
        exporter.stop()
    assert max(sizes) <= 2 * steady, (steady, sizes)
    record(
        "renamed_memfds",
        memfds=processes * count,
        processes=processes,
        scrapes=RENAMED_SCRAPES,
        steady_rss_mib=steady >> 20,
        max_rss_mib=max(sizes) >> 20,
    )
