"""The tmpfs mounts of every mount namespace /proc shows, and the files on them.

Each distinct mount namespace (`/proc/PID/ns/mnt`, PID 1's included) is read once, from
the `mountinfo` of one process in it; its tmpfs (and hugetlbfs) mounts are reached through
that process's root (`/proc/PID/root/<mountpoint>`), or directly in our own namespace. A
superblock seen from several namespaces or bind-mounted twice is one `TmpfsMount` (one
`st_dev`), walked once; a mount hidden under another mount is reached through another
namespace that shows it, else not at all (its files are then unattributed).

The area of a file (`area_of`: the one rule, which shm, reap and the exporter read through
the scan) comes from every mount of its superblock, in any namespace, whose root holds
it: a kubelet volume's path (`.../pods/<uid>/volumes/kubernetes.io~KIND/<name>`:
`empty_dir` for `empty-dir`, `kubelet_volume` for any other kind: secret, projected,
downward-api, configmap), else a namespace's `/dev/shm` or a container runtime's sandbox
shm (`dev_shm`), else `system`; hugetlbfs is `hugetlbfs`. Where mounts disagree the
first of that order wins: a superblock that is also a kubelet secret is never an orphan's.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import Final

from hostpool.host.model import Area

SHM_FSTYPES: Final = frozenset({"tmpfs", "devtmpfs", "hugetlbfs"})
_OCTAL: Final = re.compile(r"\\([0-7]{3})")
# kubelet: <root dir, /var/lib/kubelet by default>/pods/<uid>/volumes/kubernetes.io~KIND/<name>
_KUBELET_VOLUME: Final = re.compile(r"/pods/[^/]+/volumes/kubernetes\.io~([^/]+)/[^/]+$")
# a pod sandbox's or container's own /dev/shm tmpfs, as each runtime names its mount point:
# containerd's CRI (`<state>/io.containerd.grpc.v1.cri/sandboxes/<id>/shm`), docker
# (`<data-root>/containers/<id>/mounts/shm`), CRI-O and podman
# (`<root>/<driver>-containers/<id>/userdata/shm`)
_SANDBOX_SHM: Final = re.compile(
    r"/io\.containerd\.[^/]*cri[^/]*/sandboxes/[^/]+/shm$"
    r"|/containers/[0-9a-f]{64}/mounts/shm$"
    r"|-containers/[0-9a-f]{64}/userdata/shm$"
)
# where mounts of one superblock disagree, the first wins (never an orphan first)
_PRECEDENCE: Final[tuple[Area, ...]] = ("hugetlbfs", "kubelet_volume", "empty_dir", "dev_shm")
_RANK: Final[dict[Area, int]] = {a: len(_PRECEDENCE) - i for i, a in enumerate(_PRECEDENCE)}
# (the directory of the filesystem a mount shows, that mount's area)
View = tuple[str, Area]


def mount_area(mountpoint: str, fstype: str) -> Area:
    """The area a mount gives the files it shows (the module's docstring)."""
    if fstype == "hugetlbfs":
        return "hugetlbfs"
    volume = _KUBELET_VOLUME.search(mountpoint)
    if volume is not None:
        return "empty_dir" if volume.group(1) == "empty-dir" else "kubelet_volume"
    if mountpoint == "/dev/shm" or _SANDBOX_SHM.search(mountpoint):
        return "dev_shm"
    return "system"


def area_of(views: tuple[View, ...], path: str) -> Area:
    """The area of the file at `path` (inside its filesystem, from its root: `/a/b`) on
    a superblock its `views` show: the first, in precedence, of the views whose
    directory holds it; `system` if none."""
    best: Area = "system"
    for root, area in views:
        if _RANK.get(area, 0) > _RANK.get(best, 0) and (
            root == "/" or path == root or path.startswith(root + "/")
        ):
            best = area
    return best


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
    views: tuple[View, ...] = ()  # every mount of the superblock, in any namespace

    @property
    def hugetlb(self) -> bool:
        return self.fstype == "hugetlbfs"

    def area(self, name: str) -> Area:
        """The area of the file `name` (its path below this mount's root)."""
        base = self.fs_root.rstrip("/")
        return area_of(self.views, f"{base}/{name}")


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


@dataclass(frozen=True, slots=True)
class Superblocks:
    """The shared-memory superblocks of every namespace: one reachable TmpfsMount each
    (ours first, then each other namespace's; a whole filesystem before a bind mount of
    part of it), and the fstype and views of every one seen, reachable or not."""

    mounts: list[TmpfsMount]
    fstypes: dict[int, str]
    views: dict[int, tuple[View, ...]]

    def area(self, dev: int) -> Area:
        """The area of a file on `dev` whose path is unknown (unlinked, or on a mount
        no namespace lets us walk): its superblock's, as any of its mounts says."""
        return area_of(tuple(("/", area) for _root, area in self.views.get(dev, ())), "/")


def superblocks(namespaces: Namespaces) -> Superblocks:
    """Every namespace's mountinfo read once (see Superblocks)."""
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
    fstypes = {m.st_dev: m.fstype for m in candidates}
    views: dict[int, set[View]] = {}
    for m in candidates:
        views.setdefault(m.st_dev, set()).add((m.fs_root, mount_area(m.mountpoint, m.fstype)))
    frozen = {dev: tuple(sorted(v)) for dev, v in views.items()}
    chosen: dict[int, TmpfsMount] = {}
    for mount in sorted(candidates, key=lambda m: (m.pid is not None, len(m.fs_root))):
        if mount.st_dev in chosen:
            continue
        try:  # hidden under another mount: this path reaches something else
            if os.stat(mount.root).st_dev != mount.st_dev:
                continue
        except OSError:
            continue
        chosen[mount.st_dev] = replace(mount, views=frozen[mount.st_dev])
    return Superblocks(list(chosen.values()), fstypes, frozen)


def pids() -> list[int]:
    """Every process /proc shows, in pid order."""
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def tmpfs_dirs() -> list[TmpfsMount]:
    """One reachable mount per tmpfs superblock, of every mount namespace /proc shows
    (ours first: `/dev/shm`; others through `/proc/PID/root`)."""
    return [m for m in superblocks(mount_namespaces(pids())).mounts if m.fstype == "tmpfs"]


def tmpfs_mounts(namespaces: Namespaces) -> tuple[list[TmpfsMount], dict[int, str]]:
    """`superblocks`' reachable mounts, and the fstype of every superblock seen."""
    found = superblocks(namespaces)
    return found.mounts, found.fstypes


# a regular file found on a mount: (its path inside the mount without the leading '/',
# a path this process can reach it by, its lstat)
TmpfsFile = tuple[str, str, os.stat_result]


_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# deeper directories are not walked (their files stay unattributed, the walk incomplete):
# the walk holds one fd per level of the directory it is in
MAX_DEPTH: Final = 64


def walk(mount: TmpfsMount, skipped: list[OSError]) -> Iterator[TmpfsFile]:
    """Every regular file on `mount` (not below other mounts), through directory fds:
    symlinks are never followed, a directory or file gone meanwhile (ENOENT) is skipped;
    anything else skipped (EACCES, EMFILE, ELOOP, a directory deeper than MAX_DEPTH) is
    added to `skipped`. Each directory is listed whole and its listing closed before the
    walk descends: it holds one fd per level, whatever the tree's width."""
    top = _open_dir(mount.root, None, skipped)
    if top is None:
        return
    root = mount.root.rstrip("/")
    # the directories being walked, outermost first: (fd, path, subdirectories left)
    chain: list[tuple[int, str, Iterator[str]]] = []
    fd: int | None = top
    rel = ""
    try:
        while fd is not None:
            subdirs = yield from _files_in(mount.st_dev, root, fd, rel, skipped)
            chain.append((fd, rel, iter(subdirs)))
            fd = None
            while chain and fd is None:
                parent, prel, rest = chain[-1]
                name = next(rest, None)
                if name is None:
                    chain.pop()
                    os.close(parent)
                elif len(chain) >= MAX_DEPTH:
                    skipped.append(OSError(errno.ELOOP, "deeper than MAX_DEPTH", f"{root}/{prel}"))
                else:
                    fd = _open_dir(name, parent, skipped)
                    rel = f"{prel}/{name}" if prel else name
    finally:  # a walk abandoned part way
        for dir_fd, _rel, _rest in chain:
            os.close(dir_fd)
        if fd is not None:
            os.close(fd)


def _open_dir(name: str, dir_fd: int | None, skipped: list[OSError]) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        skipped.append(exc)
        return None


def _files_in(
    dev: int, root: str, dir_fd: int, rel: str, skipped: list[OSError]
) -> Generator[TmpfsFile, None, list[str]]:
    """The regular files of one directory; returns its subdirectories' names."""
    try:
        with os.scandir(dir_fd) as listing:
            entries = list(listing)
    except FileNotFoundError:
        return []
    except OSError as exc:
        skipped.append(exc)
        return []
    subdirs = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # gone since the listing
        except OSError as exc:
            skipped.append(exc)
            continue
        if st.st_dev != dev:
            continue  # another mount on top of this directory: walked on its own
        name = f"{rel}/{entry.name}" if rel else entry.name
        if stat.S_ISREG(st.st_mode):
            yield name, f"{root}/{name}", st
        elif stat.S_ISDIR(st.st_mode):
            subdirs.append(entry.name)
    return subdirs
