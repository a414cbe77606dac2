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
from dataclasses import dataclass, field, replace
from typing import Final

from hostpool.host import bounds, mountinfo
from hostpool.host.bounds import Budget
from hostpool.host.model import Area
from hostpool.host.mountinfo import SHM_FSTYPES, MountEntry, parse_mountinfo, unescape

__all__ = ["POD_UID", "SHM_FSTYPES", "KubeletVolume", "MountEntry", "TmpfsMount",
           "kubelet_volume", "parse_mountinfo", "superblocks", "tmpfs_dirs", "unescape",
           "walk"]  # fmt: skip
# a pod's uid: a UUID, or a static pod's 32 hex digits (its config's hash); the systemd
# driver's escaping writes a uid's '-' as '_'
POD_UID: Final = r"[0-9a-f]{8}(?:[-_][0-9a-f]{4}){3}[-_][0-9a-f]{12}|[0-9a-f]{32}"
# kubelet: <root dir, /var/lib/kubelet by default>/pods/<uid>/volumes/<plugin>/<name>
_KUBELET_VOLUME: Final = re.compile(rf"/pods/({POD_UID})/volumes/([^/]+)/([^/]+)(?:/|$)")
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


@dataclass(frozen=True, slots=True)
class KubeletVolume:
    """A kubelet volume's directory: `plugin` as kubelet names its directory
    (`kubernetes.io~secret`, `kubernetes.io~projected`, `kubernetes.io~empty-dir`, ...)."""

    pod_uid: str
    plugin: str
    name: str


def kubelet_volume(path: str) -> KubeletVolume | None:
    """The kubelet volume `path` (a mount point, or a path below one) is in, if any: the
    one rule of what a kubelet volume is, for areas and for pods."""
    m = _KUBELET_VOLUME.search(path)
    return None if m is None else KubeletVolume(m.group(1), m.group(2), m.group(3))


def mount_area(mountpoint: str, fstype: str) -> Area:
    """The area a mount gives the files it shows (the module's docstring)."""
    if fstype == "hugetlbfs":
        return "hugetlbfs"
    volume = kubelet_volume(mountpoint)
    if volume is not None:
        return "empty_dir" if volume.plugin == "kubernetes.io~empty-dir" else "kubelet_volume"
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
    # the mount points below this one in its namespace, relative to it: never entered
    skip: frozenset[str] = field(default_factory=frozenset)

    @property
    def hugetlb(self) -> bool:
        return self.fstype == "hugetlbfs"

    def area(self, name: str) -> Area:
        """The area of the file `name` (its path below this mount's root)."""
        base = self.fs_root.rstrip("/")
        return area_of(self.views, f"{base}/{name}")


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
    part of it; none reached through a mount of a non-local type: `bounds`), and the
    fstype and views of every one seen, reachable or not. `avoided`: why a superblock
    has no way that is safe to walk; `complete`: False when a table was cut short (the
    budget) or had more views than kept, or a superblock was avoided."""

    mounts: list[TmpfsMount]
    fstypes: dict[int, str]
    views: dict[int, tuple[View, ...]]
    avoided: dict[int, str] = field(default_factory=dict)
    complete: bool = True

    def area(self, dev: int) -> Area:
        """The area of a file on `dev` whose path is unknown (unlinked, or on a mount
        no namespace lets us walk): its superblock's, as any of its mounts says."""
        return area_of(tuple(("/", area) for _root, area in self.views.get(dev, ())), "/")


def superblocks(namespaces: Namespaces, budget: Budget | None = None) -> Superblocks:
    """Every namespace's mountinfo read once, as a stream (`host/mountinfo`), within
    `budget` (see Superblocks)."""
    budget = budget if budget is not None else Budget()
    sources: list[tuple[int | None, str]] = [(None, "/proc/self/mountinfo")]
    sources += [(pid, f"/proc/{pid}/mountinfo") for pid in namespaces.members.values()]
    fstypes: dict[int, str] = {}
    views: dict[int, set[View]] = {}
    chosen: dict[int, tuple[tuple[bool, int], TmpfsMount]] = {}
    avoided: dict[int, str] = {}
    complete = True
    for pid, path in sources:
        if budget.spent("mountinfo"):
            complete = False
            break
        try:
            table = mountinfo.read_table(path, budget, mount_area)
        except OSError:
            continue  # gone, or not ours to read
        fstypes.update(table.fstypes)
        for dev, seen in table.views.items():
            views.setdefault(dev, set()).update(seen)
        if not table.complete:
            complete = False
            if budget.truncated:
                continue  # a table cut short: what lies on the way is unknown
        for dev, entries in table.candidates.items():
            _choose(pid, dev, entries, table, chosen, avoided)
    frozen = {dev: tuple(sorted(v)) for dev, v in views.items()}
    mounts = [replace(m, views=frozen[m.st_dev]) for _key, m in chosen.values()]
    avoided = {dev: why for dev, why in avoided.items() if dev not in chosen}
    return Superblocks(mounts, fstypes, frozen, avoided, complete and not avoided)


def _choose(
    pid: int | None,
    dev: int,
    entries: list[MountEntry],
    table: mountinfo.Table,
    chosen: dict[int, tuple[tuple[bool, int], TmpfsMount]],
    avoided: dict[int, str],
) -> None:
    """The first of a namespace's ways to `dev` that is safe and reaches it, kept if it
    beats the one chosen so far (ours first, then the shortest fs_root)."""
    for e in entries:
        key = (pid is not None, len(e.fs_root))
        if dev in chosen and chosen[dev][0] <= key:
            return
        way = bounds.unsafe_on_the_way(e.mountpoint, table.unsafe)
        if way is not None:
            where = "our namespace" if pid is None else f"the mount namespace of pid {pid}"
            avoided.setdefault(dev, f"{e.mountpoint} in {where} lies on or under {way}, "
                                    "a mount of a type that may stall (not walked)")  # fmt: skip
            continue
        root = e.mountpoint if pid is None else f"/proc/{pid}/root{e.mountpoint}"
        try:  # hidden under another mount: this path reaches something else
            if os.stat(root).st_dev != dev:
                continue
        except OSError:
            continue
        skip = bounds.below(e.mountpoint, table.points)
        chosen[dev] = key, TmpfsMount(root, dev, e.mountpoint, e.fstype, pid, e.fs_root, skip=skip)
        return


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


def walk(
    mount: TmpfsMount, skipped: list[OSError], budget: Budget | None = None
) -> Iterator[TmpfsFile]:
    """Every regular file on `mount` (never below other mounts: the mount points of
    `mount.skip` are passed by name, never stat-ed), through directory fds: symlinks
    are never followed, a directory or file gone meanwhile (ENOENT) is skipped; anything
    else skipped (EACCES, EMFILE, ELOOP, a directory deeper than MAX_DEPTH) is added to
    `skipped`. It stops where `budget` is spent (checked at every entry: the budget then
    says `tmpfs`). A directory is read as a stream (its files yielded as they come, its
    subdirectories' names kept) and closed before the walk descends: one fd per level
    and no listing held, whatever the tree's width."""
    budget = budget if budget is not None else Budget()
    top = None if budget.spent("tmpfs") else _open_dir(mount.root, None, skipped)
    if top is None:
        return
    root = mount.root.rstrip("/")
    # the directories being walked, outermost first: (fd, path, subdirectories left)
    chain: list[tuple[int, str, Iterator[str]]] = []
    fd: int | None = top
    rel = ""
    where = _Where(mount.st_dev, root, mount.skip, budget)
    try:
        while fd is not None:
            subdirs = yield from _files_in(where, fd, rel, skipped)
            chain.append((fd, rel, iter(subdirs)))
            fd = None
            while chain and fd is None and not budget.truncated:
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


@dataclass(frozen=True, slots=True)
class _Where:
    """What a walk checks at each entry: its device, path, mount points, budget."""

    dev: int
    root: str
    skip: frozenset[str]
    budget: Budget


def _open_dir(name: str, dir_fd: int | None, skipped: list[OSError]) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        skipped.append(exc)
        return None


def _files_in(
    where: _Where, dir_fd: int, rel: str, skipped: list[OSError]
) -> Generator[TmpfsFile, None, list[str]]:
    """The regular files of one directory, as they are read; returns its subdirectories'
    names ([] when the budget ran out in it)."""
    subdirs: list[str] = []
    dev, skip, budget = where.dev, where.skip, where.budget
    try:
        with os.scandir(dir_fd) as listing:
            for entry in listing:
                if budget.spent("tmpfs"):
                    return []
                name = f"{rel}/{entry.name}" if rel else entry.name
                if skip and name in skip:
                    continue  # another mount (or this one's again): walked on its own
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone since the listing
                except OSError as exc:
                    skipped.append(exc)
                    continue
                if st.st_dev != dev:
                    continue  # another mount on top of this directory: walked on its own
                if stat.S_ISREG(st.st_mode):
                    yield name, f"{where.root}/{name}", st
                elif stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.name)
    except FileNotFoundError:
        return []
    except OSError as exc:
        skipped.append(exc)
        return []
    return subdirs
