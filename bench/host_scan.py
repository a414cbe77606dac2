"""`hostpool shm --json` and `hostpool exporter --node` at scale, next to the bare cost of
the same /proc reads, directory listings and stat calls.

Case `host`, the host of issue 33: 200 processes with 500 fds each (each holds 10 memfds
of its own, 15 of the /dev/shm files, 2 SysV segments and a shared anonymous page; the
rest of its fds are /dev/null: an engine's sockets, pipes and logs), 5,000 files in
/dev/shm (3,000 held, 2,000 orphans), 500 SysV segments (400 attached), 20 private mount
namespaces (`unshare -m`, each a sleeping process with a tmpfs of 10 files). Case
`memfds`: where a scan does the most per fd read, every fd an object (10 processes x
2,000 mapped memfds, an fd and mmap's dup each). One page per object.

Per round, in rotating order (each side in each place equally often), all in this
process:
- bare: what the scan reads, read and nothing interpreted: every process's `ns/mnt`
  link, maps, comm, fd listing and a stat per fd; each other namespace's mountinfo; a
  stat of each tmpfs root and a scandir + lstat of every directory and file there;
  /proc/sysvipc/shm and /proc/meminfo; the link of each object held only by an fd and
  one `map_files` stat per object held only by mappings (the lists made before timing);
- shm: `scan_host()` and the `--json` document encoded (`hostpool.cli.shm.encode`: what
  `hostpool shm --json` does after its imports);
- node: `HostCollector.collect()` (`hostpool exporter --node`'s scrape).
Also one `hostpool shm --json` run as a command (imports included). Ratios are side /
bare per round, their median reported; `other_cpus` is the CPU the rest of the machine
used meanwhile (other work slows every side).

Targets (issue 33): shm and node <= 1.3x bare, and under 2 s. Root only (SysV attach,
namespaces). Writes bench/results/host_scan.json. Everything made is removed on exit.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS_DIR, machine_facts, other_cpu, utc_now, write_json
from bench._host_objects import holders, namespaces, segments, shm_files
from hostpool.host.scan import scan_host

RESULTS = RESULTS_DIR / "host_scan.json"
WALL_TARGET_S = 2.0
RATIO_TARGET = 1.3
PAGE = mmap.PAGESIZE
SIDES = ("bare", "shm", "node")


def bare_plan() -> dict[str, Any]:
    """What the bare read reads beyond every process's files, found once before timing:
    the namespaces' mountinfo, the tmpfs roots walked, the fd link read per object held
    only by fds and the map_files stat per object held only by mappings (as the scan
    does: once per object, in the first process that holds it)."""
    from hostpool.host import mounts as host_mounts
    from hostpool.host.scan import pids
    from hostpool.proc.hostread import HROW_VIA, HostReader, internal_devices
    from hostpool.proc.procfs import ProcessAccessError, ProcessNotFoundError
    from hostpool.proc.scan import ROW_ALLOCATED, ROW_FDS

    every = pids()
    ns = host_mounts.mount_namespaces(every)
    walked, fstypes = host_mounts.tmpfs_mounts(ns)
    internal = internal_devices()
    reader = HostReader({internal.shmem, *internal.hugetlb, *fstypes})
    first: dict[Any, tuple[int, bytes, bool]] = {}
    measured: set[Any] = set()
    for pid in every:
        try:
            rows = reader.read(pid).rows
        except (ProcessNotFoundError, ProcessAccessError):
            continue
        for key, row in rows.items():
            via, is_fd = row[HROW_VIA]
            first.setdefault(key, (pid, via, bool(is_fd)))
            if row[ROW_FDS] or row[ROW_ALLOCATED] is not None:
                measured.add(key)
    links = [f"/proc/{pid}/fd/{via.decode()}" for pid, via, is_fd in first.values() if is_fd]
    map_files = [
        f"/proc/{pid}/map_files/{via.decode()}"
        for key, (pid, via, is_fd) in first.items()
        if not is_fd and key not in measured
    ]
    return {
        "mountinfo": [f"/proc/{pid}/mountinfo" for pid in ns.members.values()],
        "roots": [m.root for m in walked],
        "links": links,
        "map_files": map_files,
    }


def bare(plan: dict[str, Any]) -> int:
    """The same reads, listings and stats as a scan, nothing interpreted (see above)."""
    done = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        base = f"/proc/{name}"
        try:
            os.readlink(f"{base}/ns/mnt")
            with open(f"{base}/maps", "rb") as f:
                f.read()
            with open(f"{base}/comm", "rb") as f:
                f.read()
            dir_fd = os.open(f"{base}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            for entry in os.listdir(os.fsencode(f"{base}/fd")):
                try:
                    os.stat(entry, dir_fd=dir_fd)
                    done += 1
                except OSError:
                    pass
        finally:
            os.close(dir_fd)
    for path in plan["mountinfo"]:  # (another user's namespace may be gone since)
        with suppress(OSError), open(path, "rb") as f:
            f.read()
    for root in plan["roots"]:
        with suppress(OSError):
            os.stat(root)
            done += _walk(root)
    for path in ("/proc/sysvipc/shm", "/proc/meminfo"):
        with open(path, "rb") as f:
            f.read()
    for path in plan["links"]:
        with suppress(OSError):
            os.readlink(path)
    for path in plan["map_files"]:
        with suppress(OSError):
            os.stat(path)
    return done


def _walk(root: str) -> int:
    n = 0
    stack = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)]
    while stack:
        dir_fd = stack.pop()
        for entry in list(os.scandir(dir_fd)):
            st = entry.stat(follow_symlinks=False)
            n += 1
            if entry.is_dir(follow_symlinks=False):
                stack.append(os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd))
            del st
        os.close(dir_fd)
    return n


def shm_json() -> int:
    """What `hostpool shm --json` does once imported: the scan, the document encoded."""
    from hostpool.cli.shm import encode, scan

    return len(encode(scan()))


def sample(fn: Callable[[], object]) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def cli_run() -> dict[str, float]:
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "hostpool", "shm", "--json"], capture_output=True, check=True
    )
    wall = time.perf_counter() - started
    return {"wall_s": wall, "objects": float(len(json.loads(out.stdout)["objects"]))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hostpool.metrics.host import HostCollector

    tag = secrets.token_hex(3)
    held_files = args.processes * args.files_per_process
    with ExitStack() as stack:
        files_dir = f"/dev/shm/hostpool-bench-{tag}/"
        files = stack.enter_context(shm_files(files_dir.rstrip("/"), args.files))
        shmids = stack.enter_context(segments(args.segments))
        pids = stack.enter_context(
            holders(args.processes, args.fds, files, shmids, args.files_per_process, args.memfds)
        )
        stack.enter_context(namespaces(f"/tmp/hostpool-bench-{tag}", args.namespaces, 10))
        collector = HostCollector(scrape_budget=60)
        plan = bare_plan()
        view = scan_host()
        ours = [o for o in view.objects if (o.path or "").startswith(files_dir)]
        found = {
            "bench_files": len(ours),
            "bench_files_orphaned": sum(o.orphan for o in ours),
            "objects": len(view.objects),
            "holder_rows": sum(len(o.holders) for o in view.objects),
            "by_kind": dict(Counter(o.kind for o in view.objects)),
        }
        if len(ours) != args.files or found["bench_files_orphaned"] != args.files - held_files:
            raise RuntimeError(f"the scan saw {found}")
        sides: dict[str, Callable[[], object]] = {
            "bare": lambda: bare(plan),
            "shm": shm_json,
            "node": collector.collect,
        }
        for fn in sides.values():
            fn()  # warm: dentries, parsed paths
        samples: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
        ratios: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES[1:]}
        with other_cpu() as others:
            for r in range(args.rounds):
                order = list(SIDES[r % 3 :] + SIDES[: r % 3])
                got = {side: sample(sides[side]) for side in order}
                for side in SIDES:
                    samples[side].append(got[side])
                for side in SIDES[1:]:
                    ratios[side].append(
                        {k: got[side][k] / got["bare"][k] for k in ("wall_s", "cpu_s")}
                    )
        cli = cli_run()
        del pids
    median = {
        f"{side}_{k}": statistics.median(s[k] for s in samples[side])
        for side in SIDES
        for k in ("wall_s", "cpu_s")
    }
    for side in SIDES[1:]:
        for k in ("wall", "cpu"):
            median[f"ratio_{side}_{k}"] = statistics.median(r[f"{k}_s"] for r in ratios[side])
    return {
        "processes": args.processes,
        "memfds_per_process": args.memfds,
        "fds_per_process": args.fds,
        "files": args.files,
        "files_held": held_files,
        "segments": args.segments,
        "namespaces": args.namespaces,
        "host_processes": len([p for p in os.listdir("/proc") if p.isdigit()]),
        "found": found,
        "samples": samples,
        "ratios": ratios,
        "median": median,
        "cli": cli,
        "other_cpus": others["other_cpus"],
        "loadavg": os.getloadavg(),
    }


# the host, and the shape where a scan does the most per fd: every fd an object
# (10 processes x 2,000 mapped memfds, each held by its fd and mmap's dup)
CASES: dict[str, dict[str, int]] = {
    "host": {
        "processes": 200,
        "memfds": 10,
        "fds": 500,
        "files": 5000,
        "files_per_process": 15,
        "segments": 500,
        "namespaces": 20,
    },
    "memfds": {
        "processes": 10,
        "memfds": 2000,
        "fds": 0,
        "files": 0,
        "files_per_process": 0,
        "segments": 20,
        "namespaces": 0,
    },
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="repeatable")
    parser.add_argument("--scale", type=float, default=1.0, help="counts x this (a quick try)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("run as root (SysV attach, mount namespaces)")
    cases = {}
    for name in args.case or list(CASES):
        shape = {k: max(1, int(v * args.scale)) if v else 0 for k, v in CASES[name].items()}
        shape["files_per_process"] = CASES[name]["files_per_process"]
        shape["segments"] = max(shape["segments"], 2 * shape["processes"])
        case = run(argparse.Namespace(rounds=args.rounds, **shape))
        m = case["median"]
        print(
            f"{name}: shm {m['shm_wall_s']:.3f} s / node {m['node_wall_s']:.3f} s / bare "
            f"{m['bare_wall_s']:.3f} s wall; ratio (cpu) shm {m['ratio_shm_cpu']:.2f}x, node "
            f"{m['ratio_node_cpu']:.2f}x; cli {case['cli']['wall_s']:.2f} s; other cpus "
            f"{case['other_cpus']:.2f}",
            file=sys.stderr,
        )
        cases[name] = case
    write_json(
        args.output,
        {
            "benchmark": "host_scan",
            "date": utc_now(),
            "machine": machine_facts(),
            "targets": {"wall_s": WALL_TARGET_S, "ratio": RATIO_TARGET},
            "cases": cases,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
