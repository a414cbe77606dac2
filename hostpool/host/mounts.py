"""The tmpfs mounts of every mount namespace /proc shows, and the files on them.

Each distinct mount namespace (`/proc/PID/ns/mnt`, PID 1's included) is read once, from
the `mountinfo` of one process in it; its tmpfs (and hugetlbfs) mounts are reached through
that process's root (`/proc/PID/root/<mountpoint>`), or directly in our own namespace. A
superblock seen from several namespaces or bind-mounted twice is one `TmpfsMount` (one
`st_dev`), walked once; a mount hidden under another mount is reached through another
namespace that shows it, else not at all (its files are then unattributed).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

SHM_FSTYPES: Final = frozenset({"tmpfs", "devtmpfs", "hugetlbfs"})
_OCTAL: Final = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class TmpfsMount:
    """One tmpfs (or hugetlbfs) superblock: `root`, a path this process can open it by
    (`/dev/shm`, `/proc/PID/root/dev/shm`), `mountpoint` as seen in its namespace,
    `pid` the process whose namespace showed it (None: ours)."""

    root: str
    st_dev: int
    mountpoint: str
    fstype: str
    pid: int | None
    fs_root: str = "/"  # the directory of the filesystem mounted there (bind mounts)

    @property
    def hugetlb(self) -> bool:
        return self.fstype == "hugetlbfs"


@dataclass(frozen=True, slots=True)
class MountEntry:
    """A shared-memory mount line of a mountinfo file."""

    st_dev: int
    fs_root: str
    mountpoint: str
    fstype: str


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (`\\040`)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field) if "\\" in field else field


def parse_mountinfo(data: bytes) -> list[MountEntry]:
    """The tmpfs, devtmpfs and hugetlbfs mounts of a mountinfo file (proc(5)); lines
    split on `\\n` only."""
    out = []
    for line in data.split(b"\n"):
        head, sep, tail = line.partition(b" - ")
        if not sep:
            continue
        fstype = tail.split(b" ", 1)[0].decode(errors="surrogateescape")
        if fstype not in SHM_FSTYPES:
            continue
        fields = head.split(b" ")
        if len(fields) < 5:
            continue
        major, _, minor = fields[2].partition(b":")
        try:
            dev = os.makedev(int(major), int(minor))
        except ValueError:
            continue
        root, mountpoint = (unescape(f.decode(errors="surrogateescape")) for f in fields[3:5])
        out.append(MountEntry(dev, root, mountpoint, fstype))
    return out


@dataclass
class Namespaces:
    """Mount namespaces and one process in each (ours under `mine`)."""

    mine: str | None
    members: dict[str, int]  # namespace link text -> a pid in it


def mount_namespaces(pids: list[int]) -> Namespaces:
    """The distinct mount namespaces of `pids` (PID 1's first, so its own is read through
    it), each with one process; processes we may not read are skipped."""
    mine = _ns("self")
    members: dict[str, int] = {}
    for pid in sorted(pids, key=lambda p: p != 1):
        ns = _ns(pid)
        if ns is not None and ns != mine:
            members.setdefault(ns, pid)
    return Namespaces(mine, members)


def _ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def tmpfs_mounts(namespaces: Namespaces) -> tuple[list[TmpfsMount], dict[int, str]]:
    """One reachable TmpfsMount per shared-memory superblock (ours first, then each other
    namespace's; a whole filesystem before a bind mount of part of it), and the st_dev
    and fstype of every such mount seen, reachable or not."""
    candidates: list[TmpfsMount] = []
    sources: list[tuple[int | None, str]] = [(None, "/proc/self/mountinfo")]
    sources += [(pid, f"/proc/{pid}/mountinfo") for pid in namespaces.members.values()]
    for pid, path in sources:
        try:
            with open(path, "rb") as f:
                entries = parse_mountinfo(f.read())
        except OSError:
            continue  # gone, or not ours to read
        for e in entries:
            root = e.mountpoint if pid is None else f"/proc/{pid}/root{e.mountpoint}"
            candidates.append(TmpfsMount(root, e.st_dev, e.mountpoint, e.fstype, pid, e.fs_root))
    devices = {m.st_dev: m.fstype for m in candidates}
    chosen: dict[int, TmpfsMount] = {}
    for mount in sorted(candidates, key=lambda m: (m.pid is not None, len(m.fs_root))):
        if mount.st_dev in chosen:
            continue
        try:  # hidden under another mount: this path reaches something else
            if os.stat(mount.root).st_dev != mount.st_dev:
                continue
        except OSError:
            continue
        chosen[mount.st_dev] = mount
    return list(chosen.values()), devices


# a regular file found on a mount: (its path inside the mount without the leading '/',
# a path this process can reach it by, its lstat)
TmpfsFile = tuple[str, str, os.stat_result]


def walk(mount: TmpfsMount) -> Iterator[TmpfsFile]:
    """Every regular file on `mount` (not below other mounts), through directory fds:
    symlinks are never followed, a directory or file gone meanwhile is skipped."""
    try:
        top = os.open(mount.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    stack: list[tuple[int, str]] = [(top, "")]
    root = mount.root.rstrip("/")
    try:
        while stack:
            dir_fd, rel = stack.pop()
            try:
                yield from _files_in(mount.st_dev, root, dir_fd, rel, stack)
            finally:
                os.close(dir_fd)
    finally:  # a walk abandoned part way
        for dir_fd, _rel in stack:
            os.close(dir_fd)


def _files_in(
    dev: int, root: str, dir_fd: int, rel: str, stack: list[tuple[int, str]]
) -> Iterator[TmpfsFile]:
    try:
        entries = list(os.scandir(dir_fd))
    except OSError:
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # gone since the listing
        if st.st_dev != dev:
            continue  # another mount on top of this directory: walked on its own
        name = f"{rel}/{entry.name}" if rel else entry.name
        if stat.S_ISREG(st.st_mode):
            yield name, f"{root}/{name}", st
        elif stat.S_ISDIR(st.st_mode):
            try:
                fd = os.open(
                    entry.name,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=dir_fd,
                )
            except OSError:
                continue  # gone, or not ours to read: its files stay unattributed
            stack.append((fd, name))
