"""Every shared-memory object a process holds, whatever its name: the host view's read of
one process's maps and fds, through the same C loops as the exporter's (`bulkread`).

An object is shared memory when its inode lies on a shared-memory device: the kernel's
internal shmem mount (memfds, SysV segments, MAP_SHARED|MAP_ANONYMOUS memory, which maps
shows as `/dev/zero (deleted)`), the internal hugetlbfs mounts (hugetlb memfds,
`/anon_hugepage`), and every tmpfs or hugetlbfs mount the caller found. The device, not
the name, decides: a file named `memfd:x` on ext4 is no object, and a memfd named
anything is one. maps is split on `\\n` only (a name may hold any other byte).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Final, Literal

from hostpool.proc import bulkread
from hostpool.proc.procfs import (
    GONE,
    FdDir,
    Pid,
    ProcessAccessError,
    ProcessNotFoundError,
    read_proc_bytes,
    walk,
)
from hostpool.proc.scan import (
    ROW_ALLOCATED,
    ROW_MATCH,
    ROW_PATH,
    ROW_SMAPS,
    SMAPS,
    VMAS,
    Key,
    Row,
)

# a host row: the exporter's seven fields (hostpool.proc.scan.ROW_*), then these
HROW_VIA, HROW_SHARED, HROW_SIZE, HROW_MTIME, HROW_CTIME = range(7, 12)

Hint = Literal["memfd", "sysv", "anon", "file"]
PathInfo = tuple[Hint, str]  # what a path says: (kind hint, name)

_DELETED: Final = " (deleted)"
_ANON_PATHS: Final = ("/dev/zero", "/anon_hugepage")  # shmem_zero_setup, MAP_HUGETLB
_MFD_CLOEXEC, _MFD_HUGETLB, _MFD_HUGE_SHIFT = 0x1, 0x4, 26
_HUGEPAGES: Final = "/sys/kernel/mm/hugepages"


@dataclass(frozen=True, slots=True)
class InternalDevices:
    """The kernel's own shared-memory mounts, as st_dev: shmem's (memfds, SysV, shared
    anonymous memory) and one hugetlbfs per huge page size."""

    shmem: int
    hugetlb: frozenset[int]


@lru_cache(maxsize=1)
def internal_devices() -> InternalDevices:
    """Found by making (and closing at once) an empty memfd of each kind: the kernel
    names no other way to them. Fixed for the boot: asked once."""
    try:
        fd = os.memfd_create("hostpool-probe", _MFD_CLOEXEC)
    except OSError:  # memfd_create refused (a seccomp profile): shared anonymous memory
        shmem = _shmem_device_of_a_shared_mapping()
    else:
        try:
            shmem = os.fstat(fd).st_dev
        finally:
            os.close(fd)
    hugetlb = set()
    try:
        sizes = os.listdir(_HUGEPAGES)
    except OSError:
        sizes = []
    for entry in sizes:  # hugepages-2048kB
        kib = entry.removeprefix("hugepages-").removesuffix("kB")
        if not kib.isdigit():
            continue
        shift = (int(kib) * 1024).bit_length() - 1
        try:  # an empty hugetlb memfd reserves nothing
            fd = os.memfd_create("hostpool-probe", _MFD_CLOEXEC | _MFD_HUGETLB | shift << 26)
        except OSError:
            continue
        try:
            hugetlb.add(os.fstat(fd).st_dev)
        finally:
            os.close(fd)
    return InternalDevices(shmem, frozenset(hugetlb))


def _shmem_device_of_a_shared_mapping() -> int:
    """The shmem device as maps shows it for a MAP_SHARED|MAP_ANONYMOUS page of ours
    (`/dev/zero (deleted)`, read by the one maps parser, bulkread)."""
    import ctypes
    import mmap

    with mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_SHARED) as m:
        buf = (ctypes.c_char * 1).from_buffer(m)
        address = ctypes.addressof(buf)
        del buf
        data = read_proc_bytes("self", "/proc/self/maps")
    rows, _unnamed = bulkread.maps_objects(data, (b"/dev/zero",), {}, None, VMAS)
    for key, row in rows.items():
        starts = {vma[0] for mapping in row[-1] for vma in mapping}
        if not isinstance(key, bytes) and address in starts:
            return os.makedev(key[1], key[2])
    raise OSError("no shared anonymous mapping in /proc/self/maps")


def classify(path: bytes) -> PathInfo:
    """What a maps path or fd link says of an object on a shared-memory device: its kind
    hint and name (the device decides the kind in the end: hostpool.host.scan)."""
    text = path.decode(errors="surrogateescape").removesuffix(_DELETED)
    if text.startswith("/memfd:"):
        return "memfd", text[len("/memfd:") :]
    if text.startswith("/SYSV") and len(text) == 13:  # `/SYSV%08x`, the segment's key
        return "sysv", "0x" + text[5:]
    if text in _ANON_PATHS:
        return "anon", text
    return "file", text


def key_identity(key: Key) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a row key; None for an inode-less one (a path)."""
    if isinstance(key, bytes):
        return None
    ino, major, minor = key
    return os.makedev(major, minor), ino


@dataclass(frozen=True, slots=True)
class ProcessObjects:
    """The objects one process holds: a host row per object (`HROW_*`), each named."""

    pid: int
    rows: dict[Key, Row]
    complete: bool  # False when the deadline stopped the fd reading part way


class HostReader:
    """Reads processes against one set of shared-memory devices. Paths met are
    classified once and kept for the reader's life (one scan)."""

    def __init__(self, devices: Collection[int]) -> None:
        self.devices = set(devices)
        self.paths: dict[bytes, PathInfo] = {}
        self.named: dict[Key, PathInfo] = {}  # fd-only objects named by a link already

    def read(self, pid: Pid, *, deadline: float | None = None) -> ProcessObjects:
        """Every object on the devices that `pid` maps or holds an fd for. Raises
        ProcessNotFoundError / ProcessAccessError like the other readers."""
        pid_read, rows, complete = walk(pid, self._mapped, partial(self._held, deadline))
        return ProcessObjects(pid_read, rows, complete)

    def _mapped(self, data: bytes) -> dict[Key, Row]:
        rows, unnamed = bulkread.maps_objects(data, (), self.paths, self.devices)
        for key in unnamed:
            row = rows[key]
            info = self.paths.get(row[ROW_PATH])
            if info is None:
                info = self.paths[row[ROW_PATH]] = classify(row[ROW_PATH])
            row[ROW_MATCH] = info
        return rows

    def _held(self, deadline: float | None, rows: dict[Key, Row], fd_dir: FdDir) -> bool:
        _refused, read = bulkread.stat_fds(fd_dir.fd, fd_dir.entries, rows, deadline, self.devices)
        # fd-only objects: named by their link, once per object
        for key, row in list(rows.items()):
            if row[ROW_MATCH] is None:
                self._name_by_link(fd_dir.pid, fd_dir.path, fd_dir.fd, key, row, rows)
        return read == len(fd_dir.entries)

    def _name_by_link(
        self, pid: Pid, fd_dir: str, dir_fd: int, key: Key, row: Row, rows: dict[Key, Row]
    ) -> None:
        info = self.named.get(key)
        if info is None:
            try:
                target = os.readlink(row[HROW_VIA][0], dir_fd=dir_fd)
            except GONE:
                del rows[key]  # closed since it was stat-ed
                return
            except PermissionError:
                raise ProcessAccessError(pid, fd_dir) from None
            except OSError:  # a link the kernel cannot spell (ENAMETOOLONG)
                target = b"?"
            info = self.named[key] = classify(target)
            row[ROW_PATH] = target
        row[ROW_MATCH] = info


def map_files_stat(pid: int, via: bytes) -> os.stat_result | None:
    """The stat of the object behind a process's VMA (/proc/PID/map_files/START-END:
    root with CAP_SYS_ADMIN only), None when gone or refused."""
    try:
        return os.stat(b"/proc/%d/map_files/%s" % (pid, via))
    except OSError:
        return None


def smaps_resident(pid: int, keys: Collection[Key]) -> dict[Key, int]:
    """Rss + hugetlb pages of `pid`'s VMAs of the objects `keys` (identities), from smaps
    (for those map_files refused), parsed in C as maps is. A process gone gives {}."""
    devices = {os.makedev(key[1], key[2]) for key in keys if not isinstance(key, bytes)}
    try:
        data = read_proc_bytes(pid, f"/proc/{pid}/smaps")
    except (ProcessNotFoundError, ProcessAccessError):
        return {}
    rows, _unnamed = bulkread.maps_objects(data, (), {}, devices, SMAPS)
    return {key: row[ROW_SMAPS] for key, row in rows.items() if key in keys}


def held_bytes(row: Row) -> int | None:
    """The pages a row's first fd measured (st_blocks * 512), None if no fd did."""
    value: int | None = row[ROW_ALLOCATED]
    return value
