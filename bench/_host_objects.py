"""The shared-memory objects bench/host_scan.py makes a host of: /dev/shm files, SysV
segments, holder processes, private mount namespaces. Each context manager removes
everything it made (files, segments, processes, mounts) on exit."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]


@contextmanager
def shm_files(directory: str, count: int) -> Iterator[list[str]]:
    os.mkdir(directory, 0o700)
    try:
        paths = []
        page = b"\1" * PAGE
        for i in range(count):
            path = f"{directory}/f{i}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, page)
            os.close(fd)
            paths.append(path)
        yield paths
    finally:
        shutil.rmtree(directory)


@contextmanager
def segments(count: int) -> Iterator[list[int]]:
    ids: list[int] = []
    try:
        for _ in range(count):
            shmid = _libc.shmget(0, PAGE, 0o600 | 0o1000)
            if shmid < 0:
                raise OSError(ctypes.get_errno(), "shmget (kernel.shmmni?)")
            ids.append(shmid)
        yield ids
    finally:
        for shmid in ids:  # removed now if unattached, else with the last detach
            _libc.shmctl(shmid, 0, None)


def _hold(
    files: list[str], shmids: list[int], memfds: int, fds: int, ready: int, hold: int
) -> None:
    """A holder's body (forked child): see the module's docstring."""
    keep: list[Any] = []
    for i in range(memfds):
        fd = os.memfd_create(f"hostpool.bench.{os.getpid()}.{i}", os.MFD_CLOEXEC)
        os.ftruncate(fd, PAGE)
        keep.append(mmap.mmap(fd, PAGE))  # fd + mmap's dup
        keep[-1][0] = 1
    for path in files:
        fd = os.open(path, os.O_RDWR)
        keep.append(mmap.mmap(fd, PAGE))  # fd + mmap's dup
    for shmid in shmids:
        at = _libc.shmat(shmid, None, 0)
        ctypes.memset(at, 1, 1)
    anon = mmap.mmap(-1, PAGE, flags=mmap.MAP_SHARED)
    anon[0] = 1
    null = os.open(os.devnull, os.O_RDONLY)
    have = len(os.listdir("/proc/self/fd")) - 1  # the listing's own fd is not ours
    for _ in range(fds - have):
        os.dup(null)
    os.write(ready, b"1")
    os.read(hold, 1)


@contextmanager
def holders(
    processes: int,
    fds: int,
    files: list[str],
    shmids: list[int],
    per_process_files: int,
    memfds: int,
) -> Iterator[list[int]]:
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pids = []
    try:
        for i in range(processes):
            mine = files[i * per_process_files : (i + 1) * per_process_files]
            attach = shmids[i * 2 : i * 2 + 2]
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.close(ready_r)
                    os.close(hold_w)
                    _hold(mine, attach, memfds, fds, ready_w, hold_r)
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        os.close(ready_w)  # a child that dies closes its end: the read below ends
        ready_w = -1
        for _ in pids:
            if os.read(ready_r, 1) != b"1":
                raise RuntimeError("a holder died before it was ready")
        yield pids
    finally:
        os.close(hold_w)  # each child's read returns: they exit
        for fd in (ready_r, ready_w, hold_r):
            if fd >= 0:
                os.close(fd)
        for pid in pids:
            os.waitpid(pid, 0)


@contextmanager
def namespaces(base: str, count: int, files: int) -> Iterator[list[int]]:
    procs: list[subprocess.Popen[str]] = []
    os.mkdir(base, 0o700)
    try:
        for i in range(count):
            mnt = f"{base}/ns{i}"
            os.mkdir(mnt)
            script = (
                f'mount -t tmpfs -o size=16m hostpool-bench "$0" && '
                f'for i in $(seq {files}); do head -c {PAGE} /dev/zero > "$0/f$i"; done && '
                "echo ready && exec sleep 3600"
            )
            proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script, mnt],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(base)
