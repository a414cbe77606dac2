"""The host view at a node's extremes (issue 43 pts 3-4): time and peak memory of a scan
that meets a million files on one tmpfs, a tree deeper than the walk goes, and a
namespace full of bind mounts.

Every case is built in a private mount namespace (`unshare -m`) on a private tmpfs
mounted over that namespace's /dev/shm, so nothing lands on the host's. Each side runs
in a fresh Python process in that namespace and reports its own `VmHWM` (the peak RSS
the kernel kept for it, /proc/self/status) and its wall time:

- node: one `exporter --node` scrape as the exporter's reader runs it
  (`HostCollector.collect()` under its default 5 s budget, or HOSTPOOL_SCALE_BUDGET's),
  peak RSS next to the DaemonSet's 256 MiB memory limit
  (deploy/kubernetes/exporter-daemonset.yaml);
- exporter: a real `hostpool exporter --node` (listener and sandboxed reader), one
  /metrics scrape timed over HTTP, each process's VmHWM;
- shm: `hostpool shm --json` as a command (its output to /dev/null).

Cases: `files` (N empty files in one directory), `deep` (a chain of 1,500 directories
with a file every 3 levels), `mounts` (N bind mounts of the tmpfs, each on a directory
of its own: N mountinfo lines, N mounts of one superblock). Root only. Writes
bench/results/host_scale.json.

`python bench/host_scale.py [--files N] [--mounts N] [--namespaces K] [--sides node,shm]`;
`python bench/host_scale.py child SIDE` is what each side runs (a JSON line).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# HOSTPOOL_SCALE_CODE: another checkout's package to measure (the code before a change)
if os.environ.get("HOSTPOOL_SCALE_CODE"):
    sys.path.insert(0, os.environ["HOSTPOOL_SCALE_CODE"])

from bench._common import RESULTS_DIR, machine_facts, other_cpu, utc_now, write_json

RESULTS = RESULTS_DIR / "host_scale.json"
LIMIT_MIB = 256  # the DaemonSet's memory limit
SHM_LIMIT_MIB = 512  # what `hostpool shm` may use
DEEP_LEVELS = 1500
_MS_BIND = 4096


def vmhwm_kib(pid: int | str = "self") -> int:
    """The peak resident set of a process, from its /proc status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def child(side: str) -> dict[str, Any]:
    """One side, in this process: its wall time, VmHWM and what it said."""
    started = time.monotonic()
    out: dict[str, Any] = {"side": side}
    if side == "node":
        from hostpool.metrics.host import HostCollector

        budget = float(os.environ.get("HOSTPOOL_SCALE_BUDGET", "5"))  # the exporter's default
        families = {f.name: f for f in HostCollector(scrape_budget=budget).collect()}
        samples = {f.name: f.samples for f in families.values()}
        out["truncated"] = samples["hostpool_host_scrape_truncated"][0].value
        out["phase"] = [
            s.labels["phase"]
            for s in samples.get("hostpool_host_scrape_truncated_phase", [])
            if s.value
        ]
        out["file_objects"] = sum(
            s.value for s in samples["hostpool_host_shm_objects"] if s.labels["kind"] == "file"
        )
    elif side == "exporter":
        out.update(real_exporter())
    elif side == "shm":
        from hostpool.cli import main

        saved = os.dup(1)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        try:
            out["rc"] = main(["shm", "--json"])
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(null)
            os.close(saved)
    else:
        raise SystemExit(f"unknown side {side!r}")
    out["seconds"] = round(time.monotonic() - started, 3)
    out["vmhwm_mib"] = round(vmhwm_kib() / 1024, 1)
    return out


def real_exporter() -> dict[str, Any]:
    """A real `hostpool exporter --node` (its listener and its reader: two processes),
    one /metrics scrape timed, each process's VmHWM, then stopped."""
    import socket
    import urllib.request

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = str(Path(sys.executable).with_name("hostpool"))
    env = dict(os.environ)
    if os.environ.get("HOSTPOOL_SCALE_CODE"):
        env["PYTHONPATH"] = os.environ["HOSTPOOL_SCALE_CODE"]
    proc = subprocess.Popen([exe, "exporter", "--node", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read()
                break
            except OSError:
                time.sleep(0.1)
        started = time.monotonic()
        status, text = _scrape(f"http://127.0.0.1:{port}/metrics")
        seconds = time.monotonic() - started
        while status != 200 and time.monotonic() - started < 120:  # its scan still runs
            time.sleep(1)
            status_again, text = _scrape(f"http://127.0.0.1:{port}/metrics")
            if status_again == 200:
                break
        answered = time.monotonic() - started
        lines = text.decode().splitlines()
        readers = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
                   .read_text().split()]  # fmt: skip
        return {
            "scrape_s": round(seconds, 3),
            "status": status,  # the first scrape's HTTP status (503: no scan ended in time)
            "answered_s": round(answered, 3),  # until a scrape got the scan's figures
            "truncated": float(next(x.split()[1] for x in lines
                                    if x.startswith("hostpool_host_scrape_truncated "))),
            "phase": [x.split('"')[1] for x in lines
                      if x.startswith("hostpool_host_scrape_truncated_phase") and
                      x.endswith(" 1.0")],
            "listener_vmhwm_mib": round(vmhwm_kib(proc.pid) / 1024, 1),
            # one process before the privilege split: it reads the host itself
            "reader_vmhwm_mib": round(max(vmhwm_kib(r) for r in readers or [proc.pid]) / 1024, 1),
        }  # fmt: skip
    finally:
        proc.terminate()
        proc.wait()


def _scrape(url: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def make_files(directory: str, count: int) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(count):
            os.close(os.open(f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


def make_deep(directory: str, levels: int) -> None:
    """A chain of `levels` directories (through directory fds: no path grows), with a file
    every 3 levels."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(levels):
        if level % 3 == 0:
            os.close(os.open(f"f{level}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)


def make_mounts(source: str, target: str, count: int) -> int:
    """`count` bind mounts of `source`, each on a directory of its own under a tmpfs
    mounted on `target` (mount(2) directly: one exec each would take minutes; stacked on
    one directory the kernel itself takes seconds per mountinfo read); returns how many
    the kernel took (fs.mount-max)."""
    libc = ctypes.CDLL(None, use_errno=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "hostpool-scale-mnt", target],
                   check=True)  # fmt: skip
    for i in range(count):
        os.mkdir(f"{target}/m{i}")
        if libc.mount(source.encode(), f"{target}/m{i}".encode(), None, _MS_BIND, None) != 0:
            return i
    return count


def build_and_measure(
    case: str, count: int, sides: list[str], namespaces: int = 1
) -> dict[str, Any]:
    """In this (private) namespace: a tmpfs on /dev/shm, the case made (`mounts`: copied
    into `namespaces` - 1 more mount namespaces, each a sleeper), each side run."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g", "hostpool-scale", "/dev/shm"],
                   check=True)  # fmt: skip
    started = time.monotonic()
    made: dict[str, Any] = {"case": case, "count": count}
    if case == "files":
        make_files("/dev/shm", count)
    elif case == "deep":
        make_deep("/dev/shm", count)
    elif case == "mounts":
        made["count"] = make_mounts("/dev/shm", "/mnt", count)
    sleepers = []
    for _ in range(namespaces - 1 if case == "mounts" else 0):  # each a copy of this one
        sleepers.append(subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", "echo ready; exec sleep 600"],
            stdout=subprocess.PIPE, text=True))  # fmt: skip
        assert sleepers[-1].stdout is not None and sleepers[-1].stdout.readline() == "ready\n"
    made["namespaces"] = len(sleepers) + 1
    made["build_s"] = round(time.monotonic() - started, 1)
    runs = []
    for side in sides:
        proc = subprocess.run([sys.executable, __file__, "child", side], capture_output=True,
                              text=True, check=False)  # fmt: skip
        if proc.returncode != 0:
            runs.append({"side": side, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    made["runs"] = runs
    for sleeper in sleepers:
        sleeper.kill()
        sleeper.wait()
    return made


def run_case(case: str, count: int, sides: list[str], namespaces: int = 1) -> dict[str, Any]:
    """The case in a private mount namespace of its own (everything gone when it ends)."""
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, __file__, "case", case,
         str(count), ",".join(sides), str(namespaces)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"case {case} failed: {proc.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2])))
        return 0
    if len(sys.argv) > 3 and sys.argv[1] == "files-in":  # a test's files, made here
        make_files(sys.argv[2], int(sys.argv[3]))
        return 0
    if len(sys.argv) > 4 and sys.argv[1] == "case":
        made = build_and_measure(sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","),
                                 int(sys.argv[5]))  # fmt: skip
        print(json.dumps(made))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=1_000_000)
    p.add_argument("--mounts", type=int, default=99_000)
    p.add_argument("--namespaces", type=int, default=1, help="mount namespaces holding the mounts")
    p.add_argument("--deep", type=int, default=DEEP_LEVELS, help="levels of the deep tree")
    p.add_argument("--sides", default="node,exporter,shm")
    p.add_argument("--cases", default="files,deep,mounts")
    p.add_argument("--label", default="", help="a note stored with the results (e.g. 'old code')")
    p.add_argument("--out", default=str(RESULTS), help="the results file ('-': none)")
    p.add_argument("--merge", action="store_true", help="replace only these sides' runs")
    args = p.parse_args()
    sides = args.sides.split(",")
    counts = {"files": args.files, "deep": args.deep, "mounts": args.mounts}
    cases = []
    with other_cpu() as load:
        for case in args.cases.split(","):
            cases.append(run_case(case, counts[case], sides, args.namespaces))
            print(json.dumps(cases[-1]), flush=True)
    data = {
        "bench": "host_scale",
        "date": utc_now(),
        "label": args.label,
        "machine": machine_facts(),
        "limits_mib": {"node": LIMIT_MIB, "shm": SHM_LIMIT_MIB},
        "cases": cases,
        "other_cpus": load,
    }
    if args.merge and Path(args.out).exists():  # these sides' runs into an earlier file
        earlier = json.loads(Path(args.out).read_text())
        mine = {c["case"]: c for c in cases}
        for case in earlier["cases"]:
            new = {r["side"]: r for r in mine.get(case["case"], {}).get("runs", [])}
            case["runs"] = [new.pop(r["side"], r) for r in case["runs"]] + list(new.values())
        earlier.setdefault("merged", []).append({"sides": sides, "date": data["date"]})
        data = earlier
    if args.out != "-":
        write_json(Path(args.out), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
