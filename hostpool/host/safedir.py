"""Directories opened without following a symlink, for acting on a name inside them
(reaping): the path is walked one component at a time, each relative to the previous
one's fd with O_NOFOLLOW, so a symlink planted anywhere in it refuses the path instead of
redirecting it. The one link followed is `/proc/PID/root`, on purpose: it is how a file in
another mount namespace is reached, and everything below it is walked the same way."""

from __future__ import annotations

import errno
import os
import re
from typing import Final

from hostpool.base.fsmagic import HUGETLBFS_MAGIC, TMPFS_MAGIC, fs_magic

_DIR_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# /proc/PID/root: the magic link into another mount namespace, followed on purpose
PROC_ROOT = re.compile(r"/proc/(\d+)/root(?=/|$)")


class ShmDirs:
    """Directory fds by path, walked safely once each, closed on exit."""

    def __init__(self) -> None:
        self.fds: dict[str, int | OSError] = {}

    def __enter__(self) -> ShmDirs:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            if isinstance(fd, int):
                os.close(fd)

    def get(self, directory: str) -> int:
        """An O_PATH fd of `directory`, checked to be on tmpfs or hugetlbfs; OSError
        (cached) if not."""
        if directory not in self.fds:
            try:
                self.fds[directory] = open_shm_dir(directory)
            except OSError as exc:
                self.fds[directory] = exc
        fd = self.fds[directory]
        if isinstance(fd, OSError):
            raise fd
        return fd


def open_dir(path: str) -> int:
    """An O_PATH fd of directory `path`, walked one component at a time relative to the
    previous fd with O_NOFOLLOW: ELOOP or ENOTDIR if any component is a symlink, EINVAL
    for a relative path or a `.`/`..` component. `/proc/PID/root` is followed (the way
    into another mount namespace); nothing below it is."""
    if not path.startswith("/"):
        raise OSError(errno.EINVAL, "not an absolute path", path)
    match = PROC_ROOT.match(path)
    anchor, rest = (match.group(0), path[match.end() :]) if match else ("/", path)
    parts = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise OSError(errno.EINVAL, "'.' or '..' in the path", path)
    fd = os.open(anchor, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


# the filesystems whose files are shared memory: the only ones reaped
SHM_FILESYSTEMS: Final = {TMPFS_MAGIC: "tmpfs", HUGETLBFS_MAGIC: "hugetlbfs"}


def open_shm_dir(directory: str) -> int:
    """`open_dir`, and EXDEV unless the directory it opened is on tmpfs or hugetlbfs
    (fstatfs of the fd: the directory in hand, not whatever the path names by now)."""
    fd = open_dir(directory)
    try:
        magic = fs_magic(fd)
    except BaseException:
        os.close(fd)
        raise
    if magic not in SHM_FILESYSTEMS:
        os.close(fd)
        raise OSError(
            errno.EXDEV, f"not on tmpfs or hugetlbfs (filesystem magic {magic:#x})", directory
        )
    return fd
