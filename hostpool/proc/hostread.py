"""Every shared-memory object a process holds, whatever its name: the host view's read of
one process's maps and fds, through the same C loops as the exporter's (`bulkread`).

An object is shared memory when its inode lies on a shared-memory device: the kernel's
internal shmem mount (memfds, SysV segments, MAP_SHARED|MAP_ANONYMOUS memory, which maps
shows as `/dev/zero (deleted)`), the internal hugetlbfs mounts (hugetlb memfds,
`/anon_hugepage`), and every tmpfs or hugetlbfs mount the caller found. The device, not
the name, decides: a file named `memfd:x` on ext4 is no object, and a memfd named
anything is one. maps is split on `\\n` only (a name may hold any other byte).

A process is read as a whole: its threads share its memory (CLONE_THREAD implies
CLONE_VM), but a thread may have its own fd table (`unshare(CLONE_FILES)`), and a leader
whose main thread exited (a zombie leader) shows empty maps and fd directories while its
threads still hold everything. So the leader's maps stand unless they read empty (then
a live thread's are read), and each thread whose fd table differs from every table read
so far (`kcmp(KCMP_FILES)`: one syscall per thread; where kcmp is refused, its fd listing
compared) is read too. A holder's fds are summed over its distinct fd tables.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
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
    ROW_MAPPED,
    ROW_MAPPINGS,
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

# "unnamed": held by fds whose links all closed before they could be read (the holder
# stays; the name comes from another holder, or the file walk, or stays unknown)
Hint = Literal["memfd", "sysv", "anon", "file", "unnamed"]
PathInfo = tuple[Hint, str]  # what a path says: (kind hint, name)
UNNAMED: Final[PathInfo] = ("unnamed", "?")
Rows = dict[Key, Row]
Due = float | None  # a deadline: a time.monotonic() value
Tables = list[tuple[str, list[bytes] | None]]  # fd tables read: (task id, its fd entries)

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
    # the task whose maps were read (the pid; a thread's id when the leader's main thread
    # exited): /proc/<maps_task>/map_files and smaps reach the rows' VMAs
    maps_task: int = 0


class HostReader:
    """Reads processes against one set of shared-memory devices. Paths met are
    classified once and kept for the reader's life (one scan)."""

    def __init__(self, devices: Collection[int]) -> None:
        self.devices = set(devices)
        self.paths: dict[bytes, PathInfo] = {}
        self.named: dict[Key, tuple[PathInfo, bytes]] = {}  # fd-only objects named by a link

    def read(self, pid: Pid, *, deadline: float | None = None) -> ProcessObjects:
        """Every object on the devices that `pid` (any of its threads) maps or holds an
        fd for. Raises ProcessNotFoundError / ProcessAccessError like the other
        readers."""
        seen = _Leader()

        def mapped(data: bytes) -> dict[Key, Row]:
            seen.maps_empty = not data
            return self._mapped(data)

        def held(rows: dict[Key, Row], fd_dir: FdDir) -> bool:
            seen.entries = fd_dir.entries
            return self._held(deadline, rows, fd_dir)

        pid_read, rows, complete = walk(pid, mapped, held)
        seen.maps_task = pid_read
        tids = _other_threads(pid_read)
        if tids:
            complete = self._threads(pid_read, tids, rows, seen, deadline) and complete
        return ProcessObjects(pid_read, rows, complete, seen.maps_task)

    def _threads(
        self, pid: int, tids: list[str], rows: Rows, leader: _Leader, deadline: Due
    ) -> bool:
        """The maps of a live thread when the leader's read empty, and the fd tables of
        the threads whose table is none of those read (the leader's first)."""
        if leader.maps_empty:
            for tid in tids:
                try:
                    data = read_proc_bytes(pid, f"/proc/{pid}/task/{tid}/maps")
                except ProcessNotFoundError:
                    continue  # that thread exited meanwhile
                if data:
                    _merge_maps(rows, self._mapped(data))
                    leader.maps_task = int(tid)
                    break
        tables: Tables = [(str(pid), leader.entries)]
        complete = True
        for tid in tids:
            verdicts = []
            for other, _entries in tables:
                verdicts.append(same_fd_table(other, tid))
                if verdicts[-1]:
                    break
            if verdicts[-1]:
                continue  # a table read already
            read = self._table(pid, tid, rows, tables, None in verdicts, deadline)
            complete = read and complete
        return complete

    def _table(
        self, pid: int, tid: str, rows: Rows, tables: Tables, unsure: bool, deadline: Due
    ) -> bool:
        """Thread `tid`'s fd table counted in `rows` (and listed in `tables`), unless it
        exited or, where kcmp could not say (`unsure`), it lists the same fds as a table
        read already. False when the deadline stopped it part way."""
        path = f"/proc/{pid}/task/{tid}/fd"
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except GONE:
            return True
        except PermissionError:
            raise ProcessAccessError(pid, path) from None
        try:
            try:
                entries = os.listdir(os.fsencode(path))
            except GONE:
                return True
            except PermissionError:
                raise ProcessAccessError(pid, path) from None
            if unsure and any(listed == entries for _tid, listed in tables):
                return True
            tables.append((tid, entries))
            return self._held(deadline, rows, FdDir(pid, path, dir_fd, entries))
        finally:
            os.close(dir_fd)

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
        retry = []
        for key, row in rows.items():
            if row[ROW_MATCH] is None and not self._name_by_link(
                fd_dir, key, row, row[HROW_VIA][0]
            ):
                retry.append(key)
        if retry:
            self._name_from_other_fds(fd_dir, retry, rows)
        return read == len(fd_dir.entries)

    def _name_by_link(self, fd_dir: FdDir, key: Key, row: Row, entry: bytes) -> bool:
        """Names a row by the link of one of its fds; False when that fd closed since it
        was stat-ed (the row stays: the process held the object when it was stat-ed)."""
        named = self.named.get(key)
        if named is None:
            try:
                target = os.readlink(entry, dir_fd=fd_dir.fd)
            except GONE:
                return False
            except PermissionError:
                raise ProcessAccessError(fd_dir.pid, fd_dir.path) from None
            except OSError:  # a link the kernel cannot spell (ENAMETOOLONG)
                target = b"?"
            named = self.named[key] = (classify(target), target)
        row[ROW_MATCH], row[ROW_PATH] = named
        return True

    def _name_from_other_fds(self, fd_dir: FdDir, keys: list[Key], rows: dict[Key, Row]) -> None:
        """Rows whose first fd closed before its link was read: named by another fd of
        the same object (every fd stat-ed again, only on this rare path), else
        `UNNAMED`."""
        fds: dict[Key, list[tuple[bytes, int, int]]] = {}
        bulkread.stat_fds(fd_dir.fd, fd_dir.entries, {}, None, self.devices, fds)
        for key in keys:
            row = rows[key]
            for entry, _size, _blocks in fds.get(key, ()):
                if self._name_by_link(fd_dir, key, row, entry):
                    break
            else:
                row[ROW_MATCH] = UNNAMED


@dataclass(slots=True)
class _Leader:
    """What the walk of a process's leader read: whether its maps were empty (its main
    thread exited), its fd directory's entries, and the task whose maps stand."""

    maps_empty: bool = False
    entries: list[bytes] | None = field(default=None)
    maps_task: int = 0


def _other_threads(pid: int) -> list[str]:
    """The thread ids of `pid` but its own, [] when it has none (or exited)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    if len(tids) < 2:
        return []
    me = str(pid)
    return [tid for tid in tids if tid != me]


def _merge_maps(rows: dict[Key, Row], mapped: dict[Key, Row]) -> None:
    """A thread's maps rows joined to rows its fds made (the leader's maps read empty)."""
    for key, new in mapped.items():
        row = rows.get(key)
        if row is None:
            rows[key] = new
            continue
        row[ROW_MAPPINGS] += new[ROW_MAPPINGS]
        row[ROW_MAPPED] = max(row[ROW_MAPPED], new[ROW_MAPPED])
        row[HROW_SHARED] = row[HROW_SHARED] or new[HROW_SHARED]
        if row[ROW_MATCH] is None or row[ROW_MATCH] == UNNAMED:
            row[ROW_PATH], row[ROW_MATCH] = new[ROW_PATH], new[ROW_MATCH]


# kcmp(2): its number per architecture (no libc wrapper); KCMP_FILES compares fd tables
_SYS_KCMP: Final = {"x86_64": 312, "aarch64": 272, "riscv64": 272, "ppc64le": 354,
                    "ppc64": 354, "s390x": 343}  # fmt: skip
_KCMP_FILES: Final = 2


@lru_cache(maxsize=1)
def _kcmp() -> Callable[[int, int, int, int, int], int] | None:
    number = _SYS_KCMP.get(platform.machine())
    if number is None:
        return None
    return partial(ctypes.CDLL(None, use_errno=True).syscall, number)


def same_fd_table(a: int | str, b: int | str) -> bool | None:
    """Whether threads `a` and `b` share one fd table: kcmp(KCMP_FILES), one syscall;
    None where the kernel or a seccomp profile refuses kcmp (or the architecture's
    number is not known here). A thread gone counts as the same: it holds nothing."""
    kcmp = _kcmp()
    if kcmp is None:
        return None
    rc = kcmp(int(a), int(b), _KCMP_FILES, 0, 0)
    if rc >= 0:
        return rc == 0
    return True if ctypes.get_errno() == errno.ESRCH else None


def map_files_stat(pid: int, via: bytes) -> os.stat_result | None:
    """The stat of the object behind a process's VMA (/proc/PID/map_files/START-END:
    root with CAP_SYS_ADMIN only), None when gone or refused."""
    try:
        return os.stat(b"/proc/%d/map_files/%s" % (pid, via))
    except OSError:
        return None


def named_inode(task: int, name: str, identity: tuple[int, int]) -> os.stat_result | None:
    """The lstat of `name` (a path a VMA of `task` shows) through the task's root, if it
    still leads to the inode `identity`; None otherwise."""
    try:
        st = os.lstat(f"/proc/{task}/root{name}")
    except (OSError, ValueError):  # gone, refused, or a name with a NUL
        return None
    return st if (st.st_dev, st.st_ino) == identity else None


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
