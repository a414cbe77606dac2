"""Every shared-memory object on this host, who holds it, and the totals that close
against /proc/meminfo `Shmem` (`scan_host`); the holders of given objects right now
(`holders_of`, reap's re-check); the tmpfs mounts of every mount namespace
(`tmpfs_dirs`).

One scan: the processes' mount namespaces and their tmpfs mounts (`host/mounts`), every
process's maps and fds through the C loops (`proc/hostread`: objects by inode on the
shared-memory devices), the files on every tmpfs mount, /proc/sysvipc/shm
(`host/sysv`). Objects are joined by `(st_dev, st_ino)`; SysV segments by shmid within
our IPC namespace. Processes gone meanwhile are skipped; those we may not read are
counted (`HostView.unreadable`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import lru_cache

from hostpool.host.engines import engine_of, pool_of
from hostpool.host.model import (
    Engine,
    Holder,
    HostObject,
    HostTotals,
    HostView,
    Identity,
    ObjectKind,
)
from hostpool.host.mounts import (
    TmpfsMount,
    mount_namespaces,
    tmpfs_mounts,
    walk,
)
from hostpool.host.pods import Pods
from hostpool.host.sysv import Segment, read_segments
from hostpool.proc.hostread import (
    HROW_CTIME,
    HROW_MTIME,
    HROW_SHARED,
    HROW_SIZE,
    HROW_VIA,
    HostReader,
    PathInfo,
    internal_devices,
    key_identity,
    map_files_stat,
    smaps_resident,
)
from hostpool.proc.procfs import ProcessAccessError, ProcessNotFoundError, command_name
from hostpool.proc.scan import ROW_ALLOCATED, ROW_FDS, ROW_MAPPED, ROW_MAPPINGS, ROW_MATCH, Key, Row

__all__ = ["TmpfsMount", "holders_of", "scan_host", "tmpfs_dirs"]

_HUGE_ANON = "/anon_hugepage"
SysvKey = tuple[str, str | None, int]  # ("sysv", foreign IPC namespace or None, shmid)


def pids() -> list[int]:
    """Every process /proc shows, in pid order."""
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def tmpfs_dirs() -> list[TmpfsMount]:
    """One reachable mount per tmpfs superblock, of every mount namespace /proc shows
    (ours first: `/dev/shm`; others through `/proc/PID/root`)."""
    mounts, _devices = tmpfs_mounts(mount_namespaces(pids()))
    return [m for m in mounts if m.fstype == "tmpfs"]


def holders_of(identities: Collection[Identity]) -> dict[Identity, tuple[Holder, ...]]:
    """A fresh walk of every process's fds and maps: the holders of each of
    `identities` (one absent from the result is held by no process we may read)."""
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
                holder = Holder(pid, comm, row[ROW_FDS], row[ROW_MAPPINGS])
                found.setdefault(identity, []).append(holder)
    return {identity: tuple(holders) for identity, holders in found.items()}


@dataclass(slots=True)
class _Seen:
    """One object as the processes read so far hold it."""

    info: PathInfo
    identity: Identity | None
    holders: list[Holder] = field(default_factory=list)
    allocated: int | None = None
    size: int | None = None
    mtime: float | None = None
    mapped: int = 0
    shared: bool = False
    via: tuple[int, bytes] | None = None  # a VMA of a holder: /proc/PID/map_files name

    @classmethod
    def first(cls, pid: int, comm: str, row: Row, info: PathInfo, key: Key) -> _Seen:
        """An object as the first process holding it shows it."""
        identity = None if isinstance(key, bytes) else (os.makedev(key[1], key[2]), key[0])
        via = row[HROW_VIA]
        allocated = row[ROW_ALLOCATED]
        return cls(
            info,
            identity,
            [Holder(pid, comm, row[ROW_FDS], row[ROW_MAPPINGS])],
            allocated,
            None if allocated is None else row[HROW_SIZE],
            None if allocated is None else row[HROW_MTIME] or row[HROW_CTIME],
            row[ROW_MAPPED],
            row[HROW_SHARED],
            None if via[1] else (pid, via[0]),
        )

    def add(self, pid: int, comm: str, row: Row) -> None:
        """One process's row (processes come in pid order: holders stay sorted)."""
        self.holders.append(Holder(pid, comm, row[ROW_FDS], row[ROW_MAPPINGS]))
        if row[ROW_MAPPED] > self.mapped:
            self.mapped = row[ROW_MAPPED]
        if row[HROW_SHARED]:
            self.shared = True
        if self.allocated is None and row[ROW_ALLOCATED] is not None:
            self.allocated = row[ROW_ALLOCATED]
            self.size, self.mtime = row[HROW_SIZE], row[HROW_MTIME] or row[HROW_CTIME]
        if self.via is None and not row[HROW_VIA][1]:
            self.via = (pid, row[HROW_VIA][0])


@dataclass
class _Scan:
    reader: HostReader
    shmem: int  # the kernel's shmem mount
    mount_devices: set[int]  # every tmpfs / hugetlbfs mount's, reachable or not
    hugetlb: set[int]  # the hugetlbfs ones, the kernel's own included
    objects: dict[Key | SysvKey, _Seen] = field(default_factory=dict)
    unreadable: int = 0
    truncated: bool = False
    ipc_ns: str | None = None

    def add_process(self, pid: int, rows: dict[Key, Row]) -> None:
        comm = command_name(pid) or "?"
        objects = self.objects
        for key, row in rows.items():
            info: PathInfo = row[ROW_MATCH]
            okey: Key | SysvKey = key
            if info[0] == "sysv":
                okey = self._sysv_key(pid, key)
            elif info[1] == _HUGE_ANON and not row[HROW_SHARED]:
                continue  # a private MAP_HUGETLB mapping: no shared object
            seen = objects.get(okey)
            if seen is None:
                objects[okey] = _Seen.first(pid, comm, row, info, key)
            else:
                seen.add(pid, comm, row)

    def _sysv_key(self, pid: int, key: Key) -> SysvKey:
        """A segment is its shmid within its IPC namespace (ours: None)."""
        ns = _ipc_ns(pid) or ""
        shmid = 0 if isinstance(key, bytes) else key[0]
        return "sysv", ns if ns != self.ipc_ns else None, shmid


def _ipc_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/ipc")
    except OSError:
        return None


def scan_host(*, deadline: float | None = None) -> HostView:
    """Every shared-memory object on the host (see the module's docstring). `deadline`
    (time.monotonic()) stops reading processes part way: `HostView.complete` is then
    False and held objects of the processes not read may show as orphans."""
    now = time.time()
    every = pids()
    namespaces = mount_namespaces(every)
    mounts, fstypes = tmpfs_mounts(namespaces)
    internal = internal_devices()
    mount_devices = set(fstypes)
    hugetlb_devices = set(internal.hugetlb) | {d for d, t in fstypes.items() if t == "hugetlbfs"}
    devices = {internal.shmem, *internal.hugetlb, *mount_devices}
    scan = _Scan(
        HostReader(devices), internal.shmem, mount_devices, hugetlb_devices, ipc_ns=_ipc_ns("self")
    )
    for pid in every:
        if deadline is not None and time.monotonic() > deadline:
            scan.truncated = True
            break
        try:
            read = scan.reader.read(pid, deadline=deadline)
        except ProcessNotFoundError:
            continue
        except ProcessAccessError:
            scan.unreadable += 1
            continue
        if read.rows:
            scan.add_process(read.pid, read.rows)
        scan.truncated = scan.truncated or not read.complete
    _measure_mapped_only(scan)
    objects = _held_objects(scan, now)
    objects += _files(scan, mounts, now)
    objects += _segments(scan, read_segments(), now)
    pods = Pods()  # pod_uid and container_id where the node says (host/pods)
    pods.read_mounts(namespaces)
    objects = [pods.attribute(o) for o in objects]
    objects.sort(key=_order)
    return HostView(
        tuple(objects),
        _totals(objects),
        unreadable=scan.unreadable,
        complete=not scan.truncated,
    )


def _order(o: HostObject) -> tuple[str, str, str]:
    return o.engine, o.kind, o.name


def _measure_mapped_only(scan: _Scan) -> None:
    """Pages of the objects no fd measured (mapped only: shared anonymous memory, SysV,
    a memfd whose fd was closed): one stat of a VMA through map_files, else smaps."""
    by_pid: dict[int, list[tuple[Key, _Seen]]] = {}
    for seen in scan.objects.values():
        if seen.allocated is not None or seen.via is None:
            continue
        pid, via = seen.via
        st = map_files_stat(pid, via)
        if st is not None:
            seen.allocated, seen.size, seen.mtime = st.st_blocks * 512, st.st_size, st.st_mtime
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
        if dev in scan.mount_devices:
            continue
        hint, name = seen.info
        # a shmem file that is none of the named kinds (a GPU driver's buffer object):
        # anonymous shared memory too, dies with its holders
        kind: ObjectKind = "memfd" if hint == "memfd" else "anon_shared"
        out.append(_object(kind, name, None, seen, now, hugetlb=dev in scan.hugetlb))
    return out


@lru_cache(maxsize=1 << 16)
def _naming(base: str) -> tuple[Engine, str | None]:
    """(engine, pool) of a name (the pool only for hostpool's and sglang's names)."""
    engine = engine_of(base)
    return engine, pool_of(base) if engine in ("hostpool", "sglang") else None


def _object(
    kind: ObjectKind,
    name: str,
    path: str | None,
    seen: _Seen,
    now: float,
    *,
    hugetlb: bool,
    orphan: bool = False,
    shmid: int | None = None,
) -> HostObject:
    base = name.rpartition("/")[2] if kind == "file" else name  # a memfd's name may hold '/'
    engine, pool = _naming(base)
    size = seen.size if seen.size is not None else seen.mapped
    age = None if seen.mtime is None else max(0.0, now - seen.mtime)
    return HostObject(kind, name, path, engine, pool, size, seen.allocated or 0,
                      tuple(seen.holders), orphan, age, seen.identity, shmid, hugetlb)  # fmt: skip


def _files(scan: _Scan, mounts: list[TmpfsMount], now: float) -> list[HostObject]:
    """Every regular file on every tmpfs mount, joined to its holders; files held but
    not found there (unlinked, or on a mount no namespace shows) come last, path None."""
    out = []
    done: set[Identity] = set()
    objects = scan.objects
    for mount in mounts:
        dev, hugetlb = mount.st_dev, mount.hugetlb
        major, minor = os.major(dev), os.minor(dev)
        for name, path, st in walk(mount):
            ino = st.st_ino
            identity = (dev, ino)
            if identity in done:
                continue  # a hard link of a file already listed
            done.add(identity)
            seen = objects.get((ino, major, minor))
            if seen is None:  # an orphan: most files on a busy /dev/shm, made directly
                engine, pool = _naming(name.rpartition("/")[2])
                age = max(0.0, now - st.st_mtime)
                out.append(HostObject("file", name, path, engine, pool, st.st_size,
                                      st.st_blocks * 512, (), True, age, identity,
                                      None, hugetlb))  # fmt: skip
                continue
            seen.allocated, seen.size, seen.mtime = st.st_blocks * 512, st.st_size, st.st_mtime
            out.append(_object("file", name, path, seen, now, hugetlb=hugetlb))
    for okey, seen in objects.items():
        if seen.identity is None or seen.identity in done or not isinstance(okey, tuple):
            continue
        if okey[0] == "sysv" or seen.identity[0] not in scan.mount_devices:
            continue
        name = seen.info[1].rpartition("/")[2]
        hugetlb = seen.identity[0] in scan.hugetlb
        out.append(_object("file", name, None, seen, now, hugetlb=hugetlb))
    return out


def _segments(scan: _Scan, segments: list[Segment], now: float) -> list[HostObject]:
    """The SysV segments of our IPC namespace with their attachers, then the segments
    processes of other IPC namespaces attach (from their maps only)."""
    out = []
    for seg in segments:
        seen = scan.objects.get(("sysv", None, seg.shmid))
        if seen is None:
            seen = _Seen(("sysv", seg.name), (scan.shmem, seg.shmid))
        seen.allocated, seen.size = seg.rss, seg.size
        seen.mtime = float(seg.changed) if seg.changed else None
        hugetlb = seen.identity is not None and seen.identity[0] in scan.hugetlb
        out.append(
            _object(
                "sysv",
                seg.name,
                None,
                seen,
                now,
                hugetlb=hugetlb,
                orphan=seg.nattch == 0,
                shmid=seg.shmid,
            )
        )
    listed = {seg.shmid for seg in segments}
    for okey, seen in scan.objects.items():
        if (
            isinstance(okey, tuple)
            and okey[0] == "sysv"
            and not (okey[1] is None and okey[2] in listed)
        ):
            dev = seen.identity[0] if seen.identity else 0
            hugetlb = dev in scan.hugetlb
            out.append(
                _object("sysv", seen.info[1], None, seen, now, hugetlb=hugetlb, shmid=int(okey[2]))
            )
    return out


def _totals(objects: list[HostObject]) -> HostTotals:
    shmem = _meminfo_shmem()
    attributed = sum(o.resident_bytes for o in objects if not o.hugetlb)
    return HostTotals(
        shmem_bytes=shmem,
        attributed_bytes=attributed,
        unattributed_bytes=max(0, shmem - attributed),
        orphaned_bytes=sum(o.resident_bytes for o in objects if o.orphan and not o.hugetlb),
        hugetlb_bytes=sum(o.resident_bytes for o in objects if o.hugetlb),
        hugetlb_orphaned_bytes=sum(o.resident_bytes for o in objects if o.hugetlb and o.orphan),
    )


def _meminfo_shmem() -> int:
    with open("/proc/meminfo", "rb") as f:
        for line in f.read().split(b"\n"):
            if line.startswith(b"Shmem:"):
                return int(line.split()[1]) * 1024
    return 0
