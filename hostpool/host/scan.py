"""Every shared-memory object on this host, who holds it, and the totals that close
against /proc/meminfo `Shmem` (`scan_host`); the holders of given objects right now
(`holders_of`, reap's re-check); the tmpfs mounts of every mount namespace
(`tmpfs_dirs`).

One scan: the mount namespaces and their tmpfs mounts (`host/mounts`), every process's
maps and fds, its threads' own fd tables included (`proc/hostread`), the files on every
tmpfs mount, /proc/sysvipc/shm (`host/sysv`), joined by `(st_dev, st_ino)` (SysV: shmid
in our IPC namespace). The device decides before the name: a segment or huge anonymous
memory lies on the kernel's own shm or hugetlbfs mount (a tmpfs file named `/SYSV...` is
a file); on tmpfs only regular files are objects. A file is an orphan only unheld and in
`ORPHAN_AREAS`. Age: the newest of mtime and ctime. Processes gone meanwhile are
skipped; those we may not read are counted (`HostView.unreadable`). One time budget
bounds every phase (`host/bounds`), no lookup passes a mount that may stall, and a
scan's memory grows with what processes hold, not with the files it walks
(`scan_host(sink=)`, `host/sink`).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from operator import attrgetter

from hostpool.host import mounts
from hostpool.host.bounds import Budget
from hostpool.host.model import Holder, HostObject, HostView, Identity, ObjectKind
from hostpool.host.mounts import TmpfsMount, pids, tmpfs_dirs
from hostpool.host.pods import Pods
from hostpool.host.sink import Collected, ObjectSink, Seen, make_object, newest
from hostpool.host.sysv import Segment, read_segments
from hostpool.proc.hostread import (
    HROW_CTIME,
    HROW_MTIME,
    HROW_SHARED,
    HROW_SIZE,
    HROW_VIA,
    UNNAMED,
    HostReader,
    PathInfo,
    internal_devices,
    key_identity,
    map_files_stat,
    named_inode,
    smaps_resident,
)
from hostpool.proc.procfs import ProcessAccessError, ProcessNotFoundError, command_name
from hostpool.proc.scan import (
    ROW_ALLOCATED,
    ROW_FDS,
    ROW_MAPPED,
    ROW_MAPPINGS,
    ROW_MATCH,
    ROW_PATH,
    Key,
    Row,
)

__all__ = ["TmpfsMount", "holder", "holders_of", "pids", "scan_host", "tmpfs_dirs"]

_HUGE_ANON = "/anon_hugepage"
SysvKey = tuple[str, str | None, int]  # ("sysv", foreign IPC namespace or None, shmid)


def holder(pid: int, comm: str, row: Row) -> Holder:
    """The holder a process's row makes (every holder is built here)."""
    return Holder(pid, comm, row[ROW_FDS], row[ROW_MAPPINGS])


def holders_of(identities: Collection[Identity]) -> dict[Identity, tuple[Holder, ...]]:
    """A fresh walk of every process's fds and maps, as the scan's: the holders of each
    of `identities` (one absent from the result is held by no process we may read)."""
    wanted = set(identities)
    reader = HostReader({dev for dev, _ino in wanted})
    found: dict[Identity, list[Holder]] = {}
    for pid in pids():
        try:
            objects = reader.read(pid)
        except (ProcessNotFoundError, ProcessAccessError):
            continue
        comm: str | None = None
        for key, row in objects.rows.items():
            identity = key_identity(key)
            if identity in wanted:
                assert identity is not None
                comm = comm if comm is not None else command_name(pid) or "?"
                found.setdefault(identity, []).append(holder(pid, comm, row))
    return {identity: tuple(holders) for identity, holders in found.items()}


def _changed(row: Row) -> float | None:
    """The newest of a row's mtime and ctime (None: no fd measured it)."""
    mtime, ctime = row[HROW_MTIME], row[HROW_CTIME]
    return None if mtime is None else max(mtime, ctime or 0.0)


def _first(task: int, row: Row, info: PathInfo, key: Key, held: Holder) -> Seen:
    """An object as the first process holding it shows it (maps read at `task`)."""
    identity = None if isinstance(key, bytes) else (os.makedev(key[1], key[2]), key[0])
    via = row[HROW_VIA]
    allocated = row[ROW_ALLOCATED]
    return Seen(info, identity, [held], allocated,
                None if allocated is None else row[HROW_SIZE],
                None if allocated is None else _changed(row),
                row[ROW_MAPPED], row[HROW_SHARED],
                None if via[1] else (task, via[0]))  # fmt: skip


def _add(seen: Seen, task: int, row: Row, info: PathInfo, held: Holder) -> None:
    """One more process's row (processes come in pid order: holders stay sorted)."""
    seen.holders.append(held)
    if row[ROW_MAPPED] > seen.mapped:
        seen.mapped = row[ROW_MAPPED]
    if row[HROW_SHARED]:
        seen.shared = True
    if seen.info == UNNAMED:  # its first holder's links all closed meanwhile
        seen.info = info
    if seen.allocated is None and row[ROW_ALLOCATED] is not None:
        seen.allocated = row[ROW_ALLOCATED]
        seen.size, seen.changed = row[HROW_SIZE], _changed(row)
    if seen.via is None and not row[HROW_VIA][1]:
        seen.via = (task, row[HROW_VIA][0])


@dataclass
class _Scan:
    reader: HostReader
    shmem: int  # the kernel's shmem mount
    sysv: frozenset[int]  # the kernel's own shm and hugetlbfs mounts: where segments live
    blocks: mounts.Superblocks  # every tmpfs / hugetlbfs mount's, reachable or not
    hugetlb: set[int]  # the hugetlbfs ones, the kernel's own included
    objects: dict[Key | SysvKey, Seen] = field(default_factory=dict)
    unreadable: int = 0
    truncated: bool = False
    ipc_ns: str | None = None
    budget: Budget = field(default_factory=Budget)

    def add_process(self, pid: int, task: int, rows: dict[Key, Row]) -> None:
        comm = command_name(pid) or "?"
        objects = self.objects
        for key, row in rows.items():
            info: PathInfo = row[ROW_MATCH]
            dev = self.shmem if isinstance(key, bytes) else os.makedev(key[1], key[2])
            okey: Key | SysvKey = key
            if dev in self.blocks.fstypes:  # a file, whatever its name says
                if info[0] != "file" and info != UNNAMED:
                    info = ("file", os.fsdecode(row[ROW_PATH]).removesuffix(" (deleted)"))
            elif info[0] == "sysv" and dev in self.sysv:
                okey = self._sysv_key(pid, key)
            elif info[1] == _HUGE_ANON and dev in self.sysv and not row[HROW_SHARED]:
                continue  # a private MAP_HUGETLB mapping: no shared object
            held = holder(pid, comm, row)
            seen = objects.get(okey)
            if seen is None:
                objects[okey] = _first(task, row, info, key, held)
            else:
                _add(seen, task, row, info, held)

    def _sysv_key(self, pid: int, key: Key) -> SysvKey:
        """A segment is its shmid (its inode on the kernel's shm mount) within its IPC
        namespace (ours: None)."""
        ns = _ipc_ns(pid) or ""
        shmid = 0 if isinstance(key, bytes) else key[0]
        return "sysv", ns if ns != self.ipc_ns else None, shmid


def _ipc_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/ipc")
    except OSError:
        return None


def scan_host(*, deadline: float | None = None, sink: ObjectSink | None = None) -> HostView:
    """Every shared-memory object on the host (see the module's docstring). `deadline`
    (time.monotonic()) bounds every phase (`host/bounds`): past it the scan stops where
    it is, `HostView.complete` is False and `truncated_phase` names the phase; held
    objects of the processes not read may then show as orphans. A mount not walked and
    a tmpfs walk that skipped anything for a reason other than ENOENT make it False too.

    With a `sink`, each object goes to it as it is found (unheld files as their facts:
    `host/sink`) and the view returned holds no objects, only the totals and flags;
    without, the view holds them all, sorted by engine, kind and name."""
    now = time.time()
    budget = Budget(deadline)
    collected: Collected | None = None
    out: ObjectSink
    if sink is None:
        out = collected = Collected(now)
    else:
        out = sink
    every = pids()
    namespaces = mounts.mount_namespaces(every)
    blocks = mounts.superblocks(namespaces, budget)
    internal = internal_devices()
    fstypes = blocks.fstypes
    hugetlb_devices = set(internal.hugetlb) | {d for d, t in fstypes.items() if t == "hugetlbfs"}
    devices = {internal.shmem, *internal.hugetlb, *fstypes}
    sysv = frozenset({internal.shmem, *internal.hugetlb})
    scan = _Scan(HostReader(devices), internal.shmem, sysv, blocks, hugetlb_devices,
                 ipc_ns=_ipc_ns("self"), budget=budget)  # fmt: skip
    scan.truncated = not blocks.complete
    _read_processes(scan, every)
    _measure_mapped_only(scan)
    pods = Pods()  # pod_uid and container_id where the node says (host/pods)
    pods.read_mounts(namespaces, budget)
    for obj in _held_objects(scan, now):
        out.add(pods.attribute(obj))
    _files(scan, now, out, pods)
    if not budget.spent("sysv"):
        for obj in _segments(scan, read_segments(), now):
            out.add(pods.attribute(obj))
    complete = not (scan.truncated or budget.truncated)
    if collected is None:
        return HostView((), out.tally.totals(), scan.unreadable, complete, budget.truncated_phase)
    _sort(collected.objects)
    return HostView(tuple(collected.objects), collected.tally.totals(), scan.unreadable,
                    complete, budget.truncated_phase)  # fmt: skip


def _read_processes(scan: _Scan, every: list[int]) -> None:
    """Every process's maps and fds, until the budget is spent (phase `processes`)."""
    budget = scan.budget
    for pid in every:
        if budget.spent("processes"):
            return
        try:
            read = scan.reader.read(pid, deadline=budget.deadline)
        except ProcessNotFoundError:
            continue
        except ProcessAccessError:
            scan.unreadable += 1
            continue
        if read.rows:
            scan.add_process(read.pid, read.maps_task, read.rows)
        if not read.complete:  # the deadline stopped its fd reading part way
            scan.truncated = True
            budget.spent("processes")


def _sort(objects: list[HostObject]) -> None:
    """By engine, kind, then name: three stable sorts on one attribute each, so that no
    key tuple is made per object (docs/host-view.md, "Bounds")."""
    for attribute in ("name", "kind", "engine"):
        objects.sort(key=attrgetter(attribute))


def _measure_mapped_only(scan: _Scan) -> None:
    """Pages of the objects no fd measured (mapped only: shared anonymous memory, SysV,
    a memfd whose fd was closed): one stat of a VMA through map_files, else smaps."""
    by_pid: dict[int, list[tuple[Key, Seen]]] = {}
    for seen in scan.objects.values():
        if seen.allocated is not None or seen.via is None:
            continue
        pid, via = seen.via
        st = seen.st = map_files_stat(pid, via)
        if st is not None:
            seen.allocated, seen.size, seen.changed = st.st_blocks * 512, st.st_size, newest(st)
            continue
        if seen.identity is not None:
            key: Key = (seen.identity[1], os.major(seen.identity[0]), os.minor(seen.identity[0]))
            by_pid.setdefault(pid, []).append((key, seen))
    for pid, wanted in by_pid.items():
        resident = smaps_resident(pid, {key for key, _seen in wanted})
        for key, seen in wanted:
            seen.allocated = resident.get(key, 0)


def _held_objects(scan: _Scan, now: float) -> list[HostObject]:
    """The memfds and anonymous shared memory, found through their holders (files and
    SysV segments are `_files`' and `_segments`')."""
    out = []
    for okey, seen in scan.objects.items():
        if isinstance(okey, tuple) and okey[0] == "sysv":
            continue
        dev = seen.identity[0] if seen.identity is not None else scan.shmem
        if dev in scan.blocks.fstypes:
            continue
        hint, name = seen.info
        # a shmem file none of the named kinds (a GPU driver's buffer object, or unnamed:
        # its fds closed meanwhile): anonymous shared memory too, dies with its holders
        kind: ObjectKind = "memfd" if hint == "memfd" else "anon_shared"
        out.append(make_object(kind, name, None, seen, now, hugetlb=dev in scan.hugetlb))
    return out


def _files(scan: _Scan, now: float, out: ObjectSink, pods: Pods) -> None:
    """Every regular file on every tmpfs mount, joined to its holders (one object per
    inode: a hard link is not another), until the budget is spent (phase `tmpfs`): a
    held one to `out.add`, an unheld one to `out.add_file` (nothing kept of it here but,
    for a file of several links, its identity); then the files held but not found
    there (unlinked, or on a mount no namespace shows), path None; a mapped device node
    is none."""
    objects = scan.objects
    skipped: list[OSError] = []
    linked: set[Identity] = set()  # files of several links met so far
    for mount in scan.blocks.mounts:
        if scan.budget.spent("tmpfs"):
            break
        dev, hugetlb = mount.st_dev, mount.hugetlb
        major, minor = os.major(dev), os.minor(dev)
        pod = pods.of_dev(dev)
        for name, path, st in mounts.walk(mount, skipped, scan.budget):
            ino = st.st_ino
            if st.st_nlink > 1:
                if (dev, ino) in linked:
                    continue  # a hard link of a file already listed
                linked.add((dev, ino))
            seen = objects.get((ino, major, minor))
            if seen is None:  # unheld: most files on a busy /dev/shm, made directly
                out.add_file(name, path, st, mount.area(name), hugetlb, pod)
                continue
            seen.found = True
            seen.allocated, seen.size, seen.changed = st.st_blocks * 512, st.st_size, newest(st)
            obj = make_object("file", name, path, seen, now, hugetlb=hugetlb,
                              area=mount.area(name), links=st.st_nlink)  # fmt: skip
            out.add(pods.attribute(obj))
    scan.truncated = scan.truncated or bool(skipped)
    for okey, seen in objects.items():
        if seen.identity is None or seen.found or not isinstance(okey, tuple):
            continue
        dev = seen.identity[0]
        if okey[0] == "sysv" or dev not in scan.blocks.fstypes:
            continue
        if not _regular(seen, named=dev not in scan.blocks.avoided):
            continue
        name = seen.info[1].rpartition("/")[2]
        links = None if seen.st is None else seen.st.st_nlink
        out.add(pods.attribute(make_object("file", name, None, seen, now,
                                           hugetlb=dev in scan.hugetlb,
                                           area=scan.blocks.area(dev), links=links)))  # fmt: skip


def _regular(seen: Seen, *, named: bool) -> bool:
    """Whether a held object on a tmpfs mount that the walk did not meet is a regular
    file. An fd alone makes a row only for one; a mapping may be of a device node
    (`/dev/zero` mapped private, a GPU's node in a container's /dev): its VMA's stat
    says, else its name's if that still leads to it (`named`: not on a superblock whose
    every way passes a mount that may stall, `Superblocks.avoided`), else it is a file."""
    st = seen.st
    if st is None and named and seen.via is not None and seen.identity is not None:
        st = named_inode(seen.via[0], seen.info[1], seen.identity)
    return st is None or stat.S_ISREG(st.st_mode)


def _segments(scan: _Scan, segments: list[Segment], now: float) -> list[HostObject]:
    """The SysV segments of our IPC namespace with their attachers, then the segments
    processes of other IPC namespaces attach (from their maps only)."""
    out = []
    for seg in segments:
        seen = scan.objects.get(("sysv", None, seg.shmid))
        if seen is None:
            seen = Seen(("sysv", seg.name), (scan.shmem, seg.shmid))
        seen.allocated, seen.size = seg.rss, seg.size
        seen.changed = float(seg.changed) if seg.changed else None
        hugetlb = seen.identity is not None and seen.identity[0] in scan.hugetlb
        out.append(make_object("sysv", seg.name, None, seen, now, hugetlb=hugetlb,
                               orphan=seg.nattch == 0, shmid=seg.shmid))  # fmt: skip
    listed = {seg.shmid for seg in segments}
    for okey, seen in scan.objects.items():
        if not (isinstance(okey, tuple) and okey[0] == "sysv"):
            continue
        if okey[1] is not None or okey[2] not in listed:  # another namespace's, or gone
            hugetlb = seen.identity is not None and seen.identity[0] in scan.hugetlb
            out.append(make_object("sysv", seen.info[1], None, seen, now, hugetlb=hugetlb,
                                   shmid=int(okey[2])))  # fmt: skip
    return out
