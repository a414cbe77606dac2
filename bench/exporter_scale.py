"""`hostpool exporter` at scale, next to the bare cost of reading the same /proc files.

The case of issue 26: one unprivileged uid (65534 when run as root) runs 10 processes that
each hold 9,000 `hostpool.*` memfds, each mapped (one page touched). Two ways to hold
them: with the fd kept (the memfd's fd and mmap's dup: 2 fds per object) and with the
fd closed after mapping (only mmap's dup: 1 per object).

Per case, in rounds whose order rotates (each side in each place equally often), all
in this process, over those processes only:
- bare: read /proc/PID/maps, list /proc/PID/fd and read every fd's link (the least any
  reader of "which fds and mappings are shm" does). A link names an object but does not
  identify it (any process may name a memfd like another's) nor give its pages;
- bare_stat: read maps, list the fd directory and `os.stat` every fd (the inode that
  identifies the object an fd refers to, and its pages: the least a reader that counts
  fds per object and residency per object must do; what the exporter does per fd);
and
- scrape: `ProcfsCollector.collect()` with `--match hostpool.<tag>`: the exporter's whole
  scrape (every process on the host is looked at, as in production);
- http: a GET of /metrics from a real `hostpool exporter` subprocess (end to end).
Wall and CPU time per sample; ratios are scrape / each baseline per round. Also the CPU
the rest of the machine used meanwhile (`other_cpus`): other work makes every side
slower.

Targets (issue 26): an HTTP scrape <= 2 s; scrape <= 1.5x bare.
Writes bench/results/exporter_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS_DIR, machine_facts, other_cpu, utc_now, write_json
from hostpool.metrics.exporter import ProcfsCollector

RESULTS = RESULTS_DIR / "exporter_scale.json"
WALL_TARGET_S = 2.0
RATIO_TARGET = 1.5
UNPRIVILEGED = 65534
BASELINES = ("bare", "bare_stat")


@contextmanager
def holders(prefix: str, processes: int, objects: int, keep_fd: bool) -> Iterator[list[int]]:
    """`processes` forked children (uid 65534 when root), each holding `objects` mapped
    memfds named `<prefix>kv<i % 4>.<pid>.<i>`, until the context exits."""
    import mmap

    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:  # child: no fds but its pipe ends, then the unprivileged user
            code = 1
            try:
                os.close(ready_r)
                os.close(hold_w)
                if os.getuid() == 0:
                    os.setgroups([])
                    os.setgid(UNPRIVILEGED)
                    os.setuid(UNPRIVILEGED)
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                keep = []
                for i in range(objects):
                    fd = os.memfd_create(f"{prefix}kv{i % 4}.{os.getpid()}.{i}", os.MFD_CLOEXEC)
                    os.ftruncate(fd, mmap.PAGESIZE)
                    mm = mmap.mmap(fd, mmap.PAGESIZE)
                    mm[0] = 1
                    keep.append(mm)
                    if not keep_fd:
                        os.close(fd)
                os.write(ready_w, b"1")
                os.read(hold_r, 1)  # until the parent closes its end
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(ready_w)
    os.close(hold_r)
    try:
        for _ in pids:
            if os.read(ready_r, 1) != b"1":
                raise RuntimeError("a holder died before holding its memfds")
        yield pids
    finally:
        os.close(hold_w)
        os.close(ready_r)
        for pid in pids:
            os.waitpid(pid, 0)


def bare(pids: list[int]) -> int:
    """Read maps, list fd, read every link: what any reader of these processes does."""
    links = 0
    for pid in pids:
        with open(f"/proc/{pid}/maps", "rb") as f:
            f.read()
        fd_dir = f"/proc/{pid}/fd"
        dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for entry in os.listdir(os.fsencode(fd_dir)):
                try:
                    os.readlink(entry, dir_fd=dir_fd)
                    links += 1
                except FileNotFoundError:
                    pass
        finally:
            os.close(dir_fd)
    return links


def bare_stat(pids: list[int]) -> int:
    """Read maps, list fd, stat every fd: the identity and pages of the object each fd
    refers to."""
    stats = 0
    for pid in pids:
        with open(f"/proc/{pid}/maps", "rb") as f:
            f.read()
        fd_dir = f"/proc/{pid}/fd"
        dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for entry in os.listdir(os.fsencode(fd_dir)):
                try:
                    os.stat(entry, dir_fd=dir_fd)
                    stats += 1
                except FileNotFoundError:
                    pass
        finally:
            os.close(dir_fd)
    return stats


def sample(fn: Any) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


@contextmanager
def exporter(prefix: str) -> Iterator[str]:
    every = ["--min-scan-interval", "0"]  # a scan per scrape: each one is measured
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostpool", "exporter", "--match", prefix, "--port", "0", *every],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        event = json.loads(proc.stderr.readline())  # its first line says where it serves
        yield str(event["url"])
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def http_scrape(url: str) -> dict[str, Any]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        text = response.read().decode()
    wall = time.perf_counter() - started
    truncated = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("hostpool_exporter_scrape_truncated")
    )
    return {"wall_s": wall, "truncated": truncated == 1}


def run_case(
    prefix: str, processes: int, objects: int, keep_fd: bool, rounds: int
) -> dict[str, Any]:
    with holders(prefix, processes, objects, keep_fd) as pids:
        collector = ProcfsCollector(match=(prefix,), max_pools=32)
        expected_fds = processes * objects * (2 if keep_fd else 1)
        links = bare(pids)  # warm every side once (dentries, parsed names)
        stats = bare_stat(pids)
        families = {f.name: f for f in collector.collect()}
        fds = sum(s.value for s in families["hostpool_exporter_open_fds"].samples)
        if fds != expected_fds or min(links, stats) < expected_fds:
            raise RuntimeError(
                f"read {fds} matching fds, {links} links and {stats} stats of {expected_fds}"
            )
        sides: dict[str, Callable[[], object]] = {
            "bare": lambda: bare(pids),
            "bare_stat": lambda: bare_stat(pids),
            "scrape": collector.collect,
        }
        names = list(sides)
        samples: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        ratios: dict[str, list[dict[str, float]]] = {b: [] for b in BASELINES}
        with other_cpu() as others:
            for r in range(rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                got = {}
                for side in order:
                    got[side] = sample(sides[side])
                    samples[side].append(got[side])
                for b in BASELINES:
                    ratios[b].append({k: got["scrape"][k] / got[b][k] for k in ("wall_s", "cpu_s")})
        with exporter(prefix) as url:
            http_scrape(url)  # the first one parses every name
            http = [http_scrape(url) for _ in range(rounds)]
    median: dict[str, float] = {}
    for side, taken in samples.items():
        for k in ("wall_s", "cpu_s"):
            median[f"{side}_{k}"] = statistics.median(s[k] for s in taken)
    for b in BASELINES:
        suffix = "" if b == "bare" else f"_{b.removeprefix('bare_')}"
        for k in ("wall", "cpu"):
            median[f"ratio{suffix}_{k}"] = statistics.median(r[f"{k}_s"] for r in ratios[b])
    median["http_wall_s"] = statistics.median(h["wall_s"] for h in http)
    return {
        "processes": processes,
        "objects_per_process": objects,
        "fds_per_object": 2 if keep_fd else 1,
        "mappings": processes * objects,
        "fds": expected_fds,
        "host_processes": len(psutil.pids()),
        "samples": samples,
        "ratios": ratios["bare"],
        "ratios_stat": ratios["bare_stat"],
        "http": http,
        "other_cpus": others["other_cpus"],
        "median": median,
        "http_truncated": sum(h["truncated"] for h in http),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--objects", type=int, default=9000, help="mapped memfds per process")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    cases = {}
    for keep_fd in (True, False):
        prefix = f"hostpool.scale{secrets.token_hex(3)}_"
        name = "fd_kept" if keep_fd else "fd_closed"
        cases[name] = run_case(prefix, args.processes, args.objects, keep_fd, args.rounds)
        m = cases[name]["median"]
        print(
            f"{name}: scrape {m['scrape_wall_s']:.2f} s wall / {m['scrape_cpu_s']:.2f} s cpu, "
            f"bare {m['bare_wall_s']:.2f} / {m['bare_cpu_s']:.2f}, "
            f"bare_stat {m['bare_stat_wall_s']:.2f} / {m['bare_stat_cpu_s']:.2f}; ratio (cpu) "
            f"to bare {m['ratio_cpu']:.2f}, to bare_stat {m['ratio_stat_cpu']:.2f}; "
            f"http {m['http_wall_s']:.2f} s, "
            f"other cpus {cases[name]['other_cpus']:.2f}",
            file=sys.stderr,
        )
    write_json(
        args.output,
        {
            "benchmark": "exporter_scale",
            "date": utc_now(),
            "machine": machine_facts(),
            "targets": {"http_wall_s": WALL_TARGET_S, "ratio": RATIO_TARGET},
            "cases": cases,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
