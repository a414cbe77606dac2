"""What the share-socket attack tests have in common: a share server in its own process (so
a SIGBUS or a spinning loop shows as that process's fate, not the test runner's), a
directory every uid can reach, and the figures file docs/testing.md's attack section is
generated from (bench/results/share-attacks.json, written by `make soak` or with
HOSTPOOL_RECORD_RESULTS=1)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import helpers
from tests.helpers import Held as Held  # also for the attack tests
from tests.reliability import results
from tests.waiting import wait_for

NOBODY = 65534

# A share server: pools `fallback` (a /dev/shm file: cannot be sealed) and `sealed` (a
# memfd), 1 MiB each, filled with 1 and 2. Commands on stdin, one answer line each:
# `touch` reads every page of both pools and prints the sum (a truncated region kills it
# with SIGBUS here); `exhaust` opens /dev/null until EMFILE, as a host application at its
# fd limit would; `release` closes those again. argv: path, PoolShareServer keyword
# arguments as JSON, a log file its events are appended to, and optionally an
# RLIMIT_NOFILE.
SERVER = """
import json, logging, os, resource, sys
import torch
from hostpool import HostPoolManager
from hostpool.share import PoolShareServer
path, options, log = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
if len(sys.argv) > 4:
    limit = int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
logging.basicConfig(level=logging.INFO, filename=log, format="%(message)s")
m = HostPoolManager()
a = m.allocator("fallback", shm_backend="devshm").allocate((1 << 20,), torch.uint8)
a.fill_(1)
b = m.allocator("sealed").allocate((1 << 20,), torch.uint8)
b.fill_(2)
server = PoolShareServer(m, path, **options).start()
ballast = []
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "exhaust":
        while True:
            try:
                ballast.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        print(len(ballast), flush=True)
    elif line.strip() == "release":
        print(len(ballast), flush=True)
        while ballast:
            os.close(ballast.pop())
    else:
        print(int(a.sum()) + int(b.sum()), flush=True)
server.close()
"""
FULL_SUM = (1 << 20) * 1 + (1 << 20) * 2


class Server:
    """A share server process; `log` collects its events."""

    def __init__(self, path: str, log: str, *args: str, **options: object) -> None:
        self.log = log
        self.proc = helpers.python_child(SERVER, path, json.dumps(options), log, *args)
        self.pid = self.proc.pid

    def touch(self) -> int | None:
        """Make the server read every page of its pools: their sum, or None if it died."""
        return self.command("touch")

    def command(self, what: str) -> int | None:
        """Send a command; its answer, or None if the server died."""
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(what + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return None
        line = proc.stdout.readline()
        return int(line) if line.strip() else None

    def events(self) -> str:
        return Path(self.log).read_text() if os.path.exists(self.log) else ""

    def cpu_seconds(self) -> float:
        """user + system time of the server process so far, from /proc."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> int:
        """Close the server's stdin; its exit code (negative: killed by that signal)."""
        proc = self.proc
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode


def fds_of(pool: str) -> list[int]:
    """This process's fds of `pool` (the mapping's own dup included)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if f"hostpool.{pool}." in target:
            out.append(int(name))
    return out


@pytest.fixture
def public_dir(root: None) -> Iterator[str]:
    """A directory every uid can traverse (pytest's tmp_path is 0700)."""
    with helpers.public_dir("hostpool-share-") as top:
        yield top


def record(attack: str, **figures: object) -> None:
    """One attack's figures, into bench/results/share-attacks.json (make soak, or
    HOSTPOOL_RECORD_RESULTS=1)."""
    results.record("share-attacks", "attacks", attack, **figures)


def process_fds(pid: int | str = "self") -> dict[int, str]:
    """Every fd of a process, with its link target."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
    return out


F_SEAL_FUTURE_WRITE = 0x10
SEALED = 0x1 | 0x2 | 0x4  # F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW
MFD_HUGE_2MB = 21 << 26


FALLOC_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def punch_hole(fd: int, length: int) -> str:
    """fallocate(PUNCH_HOLE) over `fd`, as a server turning on its client does: "punched"
    or the errno's name."""
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fallocate(fd, FALLOC_PUNCH, ctypes.c_long(0), ctypes.c_long(length)) == 0:
        return "punched"
    return errno.errorcode[ctypes.get_errno()]


def wait_for_file(path: str) -> None:
    """Until `path` exists with something in it (a peer's answer)."""
    wait_for(lambda: os.path.exists(path) and os.path.getsize(path) > 0, f"{path} written")


def rogue_memfd(
    size: int, *, seals: int = SEALED, hugetlb: bool = False, fill: bool = False
) -> int:
    """A memfd as a hostile server makes it: any size (sparse unless `fill`), any seals."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    if hugetlb:
        flags |= os.MFD_HUGETLB | MFD_HUGE_2MB
    fd = os.memfd_create("rogue", flags)
    os.ftruncate(fd, size)
    if fill:
        import mmap

        with mmap.mmap(fd, size) as mm:
            mm.madvise(23)  # MADV_POPULATE_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


class RogueServer:
    """A share server that is not hostpool's: a forked process (as `uid`, if given) that
    binds `path` and answers every attach with `head` and the fds `make_fds()` returns,
    whatever was asked, and holds each connection until the client hangs up."""

    def __init__(
        self,
        path: str,
        head: dict[str, Any],
        make_fds: Callable[[], list[int]],
        *,
        uid: int | None = None,
        after_send: Callable[[list[int]], None] | None = None,
    ) -> None:
        """`after_send(fds)` runs once the fds are sent (a server turning on its client)."""

        def serve() -> str:
            import socket
            import threading

            from hostpool.share import protocol

            fds = make_fds()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(path)
            listener.listen(8)

            def loop() -> None:
                while True:
                    conn, _ = listener.accept()
                    with contextlib.suppress(OSError), conn:
                        protocol.receive(conn)
                        protocol.send(conn, head)
                        if fds:
                            protocol.send(conn, {"op": "fds", "index": 0}, fds)
                        if after_send is not None:
                            after_send(fds)
                        conn.recv(1)  # until the client hangs up

            threading.Thread(target=loop, daemon=True).start()
            return "ready"

        self._held = Held(serve, uid=uid)

    def stop(self) -> None:
        assert self._held.end() == 0


def rogue_head(regions: list[dict[str, Any]], *, readonly: bool = True) -> dict[str, Any]:
    """An attach reply in the protocol's shape, one fd packet."""
    return {"ok": True, "readonly": readonly, "reason": None, "regions": regions, "fd_packets": 1}


def dir_of(uid: int, parent: str) -> str:
    """A directory under `parent` that belongs to `uid` (where its server binds)."""
    path = tempfile.mkdtemp(prefix=f"uid{uid}-", dir=parent)
    os.chown(path, uid, uid)
    os.chmod(path, 0o755)
    return path
