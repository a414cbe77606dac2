"""The exporter DaemonSet's resources: `hostpool exporter --node`'s memory and CPU per
scrape on a node at the host-view bench's scale (issue [host-truth]).

A node of its own (fresh PID, mount and IPC namespaces: only what this bench makes is in
/proc): `--processes` processes each holding `--fds` fds (a fifth memfds, the rest files
of the node's /dev/shm, a few of each mapped), `--files` files in the node's /dev/shm,
`--namespaces` of the processes in their own mount namespace with their own tmpfs
/dev/shm and files in it (pods), `--sysv` SysV segments, a tenth attached. The exporter
runs as the DaemonSet runs it (deploy/kubernetes/exporter-daemonset.yaml: uid 0 with
only SYS_PTRACE and DAC_READ_SEARCH) and is scraped `--scrapes` times over HTTP: per
scrape its wall time and CPU seconds (utime + stime of /proc/PID/stat), its resident
memory after each, and its peak (VmHWM). The DaemonSet's requests and limits are set
from these (tests/test_kubernetes.py checks they cover them).

Writes bench/results/exporter_pod.json. Root only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS_DIR, machine_facts, other_cpu, utc_now, write_json

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
FILE_BYTES = 4096
CAPS = "-all,+sys_ptrace,+dac_read_search,+setuid,+setgid"  # the DaemonSet's
_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = ctypes.c_void_p


def _check(rc: int, what: str) -> None:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _tmpfs(path: str) -> None:
    _check(_libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, b"size=256m"), f"mount {path}")


def _write(path: str) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"\1" * FILE_BYTES)
    os.close(fd)


def _child(i: int, args: argparse.Namespace, ready: int) -> None:
    """One engine-like process: its fds, a few mappings, its own /dev/shm if a pod."""
    kept = []
    if i < args.namespaces:
        _check(_libc.unshare(CLONE_NEWNS), "unshare")
        _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make-private")
        _tmpfs("/dev/shm")
        for j in range(args.files // args.namespaces):
            _write(f"/dev/shm/vllm_offload_pod{i}_{j}.mmap")
    memfds = args.fds // 5
    for j in range(memfds):
        fd = os.memfd_create(f"hostpool.bench.{os.getpid()}.{j}")
        os.ftruncate(fd, FILE_BYTES)
        kept.append(fd)
    for j in range(args.fds - memfds):
        name = f"psm_{(i * args.fds + j) % args.files}"
        kept.append(os.open(f"/proc/1/root/dev/shm/{name}", os.O_RDWR))  # the node's
    maps = [mmap.mmap(fd, FILE_BYTES) for fd in kept[:: max(1, len(kept) // 10)]]
    os.write(ready, b"x")
    signal.pause()
    del maps


def node(args: argparse.Namespace) -> dict[str, Any]:
    _tmpfs("/dev/shm")
    for k in range(args.files):
        _write(f"/dev/shm/psm_{k}")
    segments = []
    for _ in range(args.sysv):
        shmid = _libc.shmget(IPC_PRIVATE, FILE_BYTES, IPC_CREAT | 0o600)
        _check(shmid, "shmget")
        segments.append(shmid)
    for shmid in segments[: args.sysv // 10]:
        _libc.shmat(shmid, None, 0)
    read, ready = os.pipe()
    children = []
    for i in range(args.processes):
        pid = os.fork()
        if pid == 0:
            try:
                _child(i, args, ready)
            finally:
                os._exit(1)
        children.append(pid)
    got = 0
    while got < args.processes:
        got += len(os.read(read, args.processes))
    try:
        return _scrape(args)
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _stat(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, VmRSS, VmHWM) of the exporter: its listener `pid` and its reader (the
    listener's child, where the scans run), summed as the pod's cgroup counts them."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    cpu, rss, hwm = 0.0, 0, 0
    for one in [pid, *map(int, children)]:
        fields = Path(f"/proc/{one}/stat").read_text().rpartition(")")[2].split()
        cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{one}/status").read_text().splitlines()
        )
        rss += int(status["VmRSS"].split()[0]) << 10
        hwm += int(status["VmHWM"].split()[0]) << 10
    return cpu, rss, hwm


def _scrape(args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["setpriv", f"--inh-caps={CAPS}", f"--bounding-set={CAPS}", "--",
            sys.executable, "-m", "hostpool", "exporter", "--node", "--host", "127.0.0.1",
            "--port", str(port), "--scrape-budget", "60",
            "--min-scan-interval", "0"]  # fmt: skip
    # a scan per scrape (--min-scan-interval 0): each one is measured
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=30).close()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("the exporter exited") from None
                time.sleep(0.1)
        cpu, idle_rss, _ = _stat(proc.pid)
        scrapes = []
        for _ in range(args.scrapes):
            start = time.monotonic()
            with other_cpu() as load, urllib.request.urlopen(f"{url}/metrics", timeout=120) as r:
                body = r.read().decode()
            wall = time.monotonic() - start
            now, rss, _ = _stat(proc.pid)
            scrapes.append({"wall_s": wall, "cpu_s": now - cpu, "rss_bytes": rss, **load})
            cpu = now
        peak = _stat(proc.pid)[2]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    objects = sum(
        float(line.rpartition(" ")[2])
        for line in body.splitlines()
        if line.startswith("hostpool_host_shm_objects{")
    )
    return {
        "idle_rss_bytes": idle_rss,
        "peak_rss_bytes": peak,
        "scrapes": scrapes,
        "cpu_s_median": statistics.median(s["cpu_s"] for s in scrapes),
        "cpu_s_max": max(s["cpu_s"] for s in scrapes),
        "wall_s_max": max(s["wall_s"] for s in scrapes),
        "objects_seen": int(objects),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=200)
    p.add_argument("--fds", type=int, default=500)
    p.add_argument("--files", type=int, default=5000)
    p.add_argument("--sysv", type=int, default=500)
    p.add_argument("--namespaces", type=int, default=20)
    p.add_argument("--scrapes", type=int, default=5)
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "exporter_pod.json")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        print(json.dumps(node(args)))
        return 0
    if os.geteuid() != 0:
        print("bench/exporter_pod.py needs root (namespaces)", file=sys.stderr)
        return 1
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--ipc", "--mount-proc",
         "--propagation", "private", sys.executable, *sys.argv, "--inner"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    measured = json.loads(proc.stdout)
    scale = {k: getattr(args, k) for k in ("processes", "fds", "files", "sysv", "namespaces")}
    result = {"when": utc_now(), "machine": machine_facts(), "scale": scale, **measured}
    write_json(args.output, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "scrapes")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
