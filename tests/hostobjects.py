"""Real shared-memory objects of every kind, held by real processes, for the host-view
tests: a holder process (and a forked child of it) and a process in a private mount
namespace with its own tmpfs. Each fixture-side helper cleans up everything it made."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# What the holder makes, each object `size` bytes populated, then forks a child that
# keeps every mapping (the memfd by its mapping only: it closes the fd): a memfd, a file
# in `directory` (fd + mapping), MAP_SHARED|MAP_ANONYMOUS memory, a SysV segment
# (marked for removal at once: it goes with the last detach, whatever happens to the
# test). One JSON line says what it made; it exits when its stdin closes.
HOLDER = r"""
import ctypes, json, mmap, os, sys
size, directory, tag = int(sys.argv[1]), sys.argv[2], sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
chunk = b"\1" * (1 << 20)
def fill(m):
    for off in range(0, size, 1 << 20):
        m[off:off + (1 << 20)] = chunk[: size - off]
memfd = os.memfd_create(f"{tag}.memfd", 0)
os.ftruncate(memfd, size)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
at = libc.mmap(None, size, 3, 1, memfd, 0)  # not Python's mmap: it would dup the fd
ctypes.memset(at, 1, size)
path = os.path.join(directory, f"{tag}.file")
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, size)
m2 = mmap.mmap(fd, size)
fill(m2)
anon = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
fill(anon)
shmid = libc.shmget(0, size, 0o600 | 0o1000)
assert shmid >= 0, ctypes.get_errno()
addr = libc.shmat(shmid, None, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
libc.shmctl(shmid, 0, None)  # IPC_RMID: destroyed with the last detach
ctypes.memset(addr, 1, size)
st_memfd, st_file = os.fstat(memfd), os.fstat(fd)
child = os.fork()
if child == 0:
    os.close(memfd)
    sys.stdin.read()
    os._exit(0)
print(json.dumps({
    "pid": os.getpid(), "child": child, "shmid": shmid, "path": path,
    "memfd": [st_memfd.st_dev, st_memfd.st_ino], "file": [st_file.st_dev, st_file.st_ino],
}), flush=True)
sys.stdin.read()
os.waitpid(child, 0)
"""


@dataclass
class Held:
    """What a holder made (see HOLDER) and the process holding it."""

    proc: subprocess.Popen[str]
    info: dict[str, Any]


@contextmanager
def holder(size: int, directory: str = "/dev/shm") -> Iterator[Held]:
    """A holder process with one object of each kind; all gone on exit."""
    tag = f"hostpool-test-{secrets.token_hex(4)}"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(size), directory, tag],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    path = os.path.join(directory, f"{tag}.file")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the holder died before it was ready"
        yield Held(proc, json.loads(line))
    finally:
        try:
            proc.communicate(timeout=60)  # closes stdin (EOF ends it), reads stdout
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if os.path.exists(path):
            os.unlink(path)


@contextmanager
def private_tmpfs(
    mountpoint: str, files: dict[str, int], *, bind: str | None = None, hold: str | None = None
) -> Iterator[subprocess.Popen[str]]:
    """A sleeping process in a private mount namespace (`unshare -m`) with a tmpfs on
    `mountpoint` holding `files` (name -> bytes written), none of them open; with `bind`,
    the same tmpfs bind-mounted there too; with `hold`, that file kept open by the
    sleeper. Killing it unmounts everything."""
    script = ['mount -t tmpfs -o size=1g hostpool-test "$0"']
    for name, size in files.items():
        script.append(f'head -c {size} /dev/zero > "$0/{name}"')
    if bind is not None:
        script.append(f'mount --bind "$0" {bind}')
    if hold is not None:  # the sleeper holds this one open
        script.append(f'exec 3< "$0/{hold}"')
    script.append("echo ready && exec sleep 600")
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", " && ".join(script)]
    with ready_sleeper([*argv, mountpoint]) as proc:
        yield proc


@contextmanager
def ready_sleeper(argv: list[str], **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """`argv` (with `popen`'s extra Popen arguments) started with its stdout piped; yields
    once its first line is `ready`; killed at the end."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def shmem_bytes() -> int:
    with open("/proc/meminfo", "rb") as f:
        for line in f.read().split(b"\n"):
            if line.startswith(b"Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def write_file(path: str, size: int) -> None:
    """A file of `size` bytes written (its pages allocated), closed."""
    with open(path, "xb") as f:
        chunk = b"\1" * (1 << 20)
        for off in range(0, size, 1 << 20):
            f.write(chunk[: size - off])
