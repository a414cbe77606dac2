"""Processes exiting while /proc is read: two fork loops, each keeping 16 children that
create and map a matching memfd and exit within 4 ms, while the real exporter is scraped
and scan() runs in a loop. A vanished process is skipped: no scrape fails, no traceback."""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
import urllib.error

from hostpool.proc import procgroup, scan
from tests import helpers
from tests.exporting import running_exporter, scrape, value
from tests.reliability.results import RECORD
from tests.reliability.results import record_procfs_attack as record

SECONDS = 60.0 if RECORD else 8.0  # the docs/testing.md figure comes from the long run
# The children's 0-4 ms sleep below is the attack's shape (holders that exit while they
# are read), not a synchronisation: the test waits on nothing but its own scrapes.

FORK_LOOP = """
import mmap, os, random, signal, sys, time
prefix, stop, forks, live = sys.argv[1], [], 0, 0
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("ready", flush=True)
while not stop:
    while live < 16:  # 16 children at a time, each exiting 0-4 ms after its memfd is mapped
        pid = os.fork()
        if pid == 0:
            fd = os.memfd_create(f"{prefix}.{os.getpid()}.0")
            os.ftruncate(fd, 1 << 16)
            m = mmap.mmap(fd, 1 << 16)
            m[0] = 1
            time.sleep(random.random() * 0.004)
            os._exit(0)
        live += 1
    os.waitpid(-1, 0)
    live -= 1
    forks += 1
print(forks, flush=True)
"""


def stop_loop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return int(out.split()[-1])


def test_scrapes_survive_processes_exiting_mid_read() -> None:
    prefix = f"hostpool.fork{secrets.token_hex(3)}"
    loops = [helpers.python_child(FORK_LOOP, prefix) for _ in range(2)]
    matcher = scan.Matcher((prefix,))
    scrapes = failed = scans = 0
    slowest = 0.0
    try:
        with running_exporter("--match", prefix) as exporter:
            deadline = time.monotonic() + SECONDS
            while time.monotonic() < deadline:
                started = time.monotonic()
                try:
                    _, samples = scrape(exporter.url, timeout=10)
                except (urllib.error.URLError, ConnectionError):
                    failed += 1
                else:
                    assert value(samples, "hostpool_exporter_processes", prefix=prefix) >= 0
                    scrapes += 1
                slowest = max(slowest, time.monotonic() - started)
                procgroup.scan((prefix,))  # the same reads in this process, raising here
                procgroup.scan_totals(matcher)  # and the exporter's own reader
                scans += 1
            log = exporter.stop()
    finally:
        forks = sum(stop_loop(p) for p in loops)
    assert forks > 100, f"the fork loops ran only {forks} times"
    assert (failed, scrapes > 0) == (0, True), f"{failed} of {failed + scrapes} scrapes failed"
    assert "Traceback" not in log, log
    record(
        "fork_loops",
        seconds=SECONDS,
        loops=len(loops),
        forks=forks,
        scrapes=scrapes,
        failed_scrapes=failed,
        in_process_scans=scans,
        slowest_scrape_s=round(slowest, 3),
    )
