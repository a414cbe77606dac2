"""Shared-memory fds and mappings of any process, read from /proc.

OS layer: reading only (no policy, metrics or logging configuration). `walk` is the one
way a process is read (its maps, then its fd directory against what maps showed): the
exporter's reader (`scan.read_holdings`, which `inspect` reads through too:
`procgroup.read_process`) and the host view's (`hostread`) both go through it; the lines
and fds themselves are parsed and stat-ed in C (`bulkread`). The pytest leak check lists
fds here (`shm_fds`).

What /proc shows for shared memory:
- fds: `/proc/PID/fd/N` links to `/memfd:NAME (deleted)` (memfd, hugetlb memfds too) or to
  `/dev/shm/NAME [(deleted)]` (the fallback file); `os.stat` through the link gives the
  object's (st_dev, st_ino), the only identity that survives fd-number reuse.
- mappings: lines of /proc/PID/maps with the same paths, the same (dev, ino) in the
  `dev inode` columns, and `[anon:NAME]` / `[anon_shmem:NAME]` for named anonymous VMAs
  (no fd, no inode). /proc/PID/smaps adds Rss, hugetlb pages and the page size per VMA.

Names are parsed by `hostpool.proc.names`.

A process that exits while it is read raises ProcessNotFoundError from any step (ENOENT
or ESRCH); scans skip it. Names are returned as /proc shows them (undecodable bytes as
surrogate escapes): printing them is the presentation's job (`hostpool.proc.textsafe`).

Maps and smaps lines end at `\n` only, fields are split at spaces only (bulkread.c, the
one parser of them): the kernel writes a name as it is but for `\n` (`\012`), so
`str.splitlines()` (also `\r \x0b \x0c \x1c-\x1e \x85 \u2028`) would let a memfd's name
forge lines.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

from hostpool.errors import HostPoolError
from hostpool.proc.names import (
    KNOWN_PREFIXES,
    Kind,
    ShmName,
    classify_path,
    parse_name,
)
from hostpool.proc.procaccess import why_denied, why_not_found

Pid = int | Literal["self"]


# what /proc raises for a process that has exited (or an fd closed) since it was listed:
# ENOENT once its entries are gone, ESRCH while it is being torn down
GONE: Final = (FileNotFoundError, ProcessLookupError)


class ProcfsError(HostPoolError):
    """/proc could not tell us about a process."""


class ProcessNotFoundError(ProcfsError, LookupError):
    """No such process (or it exited while being read); `hint` says what else can make a
    process look absent (hidepid, a PID namespace), when the caller asked."""

    def __init__(self, pid: Pid, hint: str = "") -> None:
        super().__init__(f"no process with pid {pid}" + (f" visible here: {hint}" if hint else ""))
        self.pid = pid
        self.hint = hint


class ProcessAccessError(ProcfsError, PermissionError):
    """The process exists but this user may not read its fds or mappings.

    The message names what is missing (procaccess.why_denied); it is worked out when
    first shown, not when raised: a scan meets hundreds of these per pass.
    """

    def __init__(self, pid: Pid, path: str) -> None:
        super().__init__(pid, path)
        self.pid = pid
        self.path = path
        self._message: str | None = None

    def __str__(self) -> str:
        if self._message is None:
            pid = os.getpid() if self.pid == "self" else self.pid
            self._message = f"permission denied reading {self.path}: {why_denied(pid)}"
        return self._message


# -- fds ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShmFd:
    """One fd of a process that refers to a shared-memory object."""

    fd: int
    target: str  # the link text, e.g. "/memfd:hostpool.kv.12.0 (deleted)"
    kind: Kind
    name: ShmName
    dev: int
    ino: int
    size: int  # st_size: the object's length
    allocated_bytes: int  # st_blocks * 512: pages the object holds now (shmem, hugetlbfs)


def open_fd_dir(pid: Pid) -> tuple[str, int]:
    """(path, open fd) of the process's /proc/PID/fd directory; the caller closes the fd.
    Raises ProcessNotFoundError / ProcessAccessError."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        return fd_dir, os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except GONE:
        raise ProcessNotFoundError(pid) from None
    except PermissionError:
        raise ProcessAccessError(pid, fd_dir) from None


def shm_fds(pid: Pid, prefixes: Sequence[str] = KNOWN_PREFIXES) -> list[ShmFd]:
    """The process's fds whose shm object name starts with one of `prefixes`, by fd."""
    fd_dir, dir_fd = open_fd_dir(pid)
    try:
        return _shm_fds_in(dir_fd, pid, fd_dir, prefixes)
    finally:
        os.close(dir_fd)


def _shm_fds_in(dir_fd: int, pid: Pid, fd_dir: str, prefixes: Sequence[str]) -> list[ShmFd]:
    # readlink/stat relative to an open /proc/PID/fd: no path walk per fd (the leak check
    # runs this around every test, over up to thousands of fds)
    out: list[ShmFd] = []
    try:
        entries = os.listdir(dir_fd)
    except GONE:  # exited between the open and the listing
        raise ProcessNotFoundError(pid) from None
    except PermissionError:
        raise ProcessAccessError(pid, fd_dir) from None
    for entry in entries:
        try:
            target = os.readlink(entry, dir_fd=dir_fd)
        except GONE:
            continue  # closed since the listing (or our own dir_fd's listing entry)
        except PermissionError:
            raise ProcessAccessError(pid, fd_dir) from None
        except OSError:
            continue  # a link /proc cannot spell (ENAMETOOLONG): not a name we look for
        for prefix in prefixes:  # cheap substring filter before any parsing or stat
            if prefix in target:
                break
        else:
            continue
        classified = classify_path(target)
        parsed = parse_name(classified[1], prefixes) if classified else None
        if classified is None or parsed is None:
            continue
        try:
            st = os.stat(entry, dir_fd=dir_fd)
        except GONE:
            continue
        out.append(ShmFd(int(entry), target, classified[0], parsed, st.st_dev, st.st_ino,
                         st.st_size, st.st_blocks * 512))  # fmt: skip
    out.sort(key=lambda f: f.fd)
    return out


# -- mappings -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """What smaps adds to a VMA: memory behind it now, and its page size."""

    rss: int
    shared_hugetlb: int
    private_hugetlb: int
    kernel_page_size: int

    @property
    def resident_bytes(self) -> int:
        # hugetlb pages are not in Rss
        return self.rss + self.shared_hugetlb + self.private_hugetlb


@dataclass(frozen=True, slots=True)
class ShmMapping:
    """One VMA (one line of /proc/PID/maps) of a shared-memory object."""

    start: int
    end: int
    perms: str
    offset: int
    dev: int  # 0 for anonymous VMAs
    ino: int  # 0 for anonymous VMAs
    kind: Kind
    name: ShmName
    usage: Usage | None = None  # set when read from smaps
    # which of its object's logical mappings in the process it belongs to (the VMAs one
    # mmap was split into share one), as bulkread joined them
    mapping: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def address(self) -> str:
        return f"{self.start:x}-{self.end:x}"


def shm_maps_lines(pid: Pid, prefixes: Sequence[str] = KNOWN_PREFIXES) -> list[str]:
    """The raw maps lines that mention a prefix: the leak check's cheap identity of VMAs."""
    data = read_proc_bytes(pid, f"/proc/{pid}/maps")  # bytes: no decoding of other lines
    wanted = [p.encode() for p in prefixes]
    if not any(contains(data, p) for p in wanted):
        return []
    return [
        line.decode(errors="surrogateescape")
        for line in data.split(b"\n")
        if any(p in line for p in wanted)
    ]


def contains(haystack: bytes, needle: bytes) -> bool:
    """`needle in haystack`, through libc's memmem where available (bytes.__contains__
    skips poorly on maps paths full of '.'; see docs/ARCHITECTURE.md)."""
    global _memmem
    if _memmem is None:
        _memmem = _load_memmem()
    if _memmem is False:
        return needle in haystack
    return bool(_memmem(haystack, len(haystack), needle, len(needle)))


def _load_memmem() -> Any:
    try:
        import ctypes

        memmem = ctypes.CDLL(None).memmem
    except (OSError, AttributeError):
        return False
    memmem.restype = ctypes.c_void_p
    memmem.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    return memmem


_memmem: Any = None  # loaded on first use; False where libc has none


def read_proc_bytes(pid: Pid, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except GONE:
        raise ProcessNotFoundError(pid) from None
    except PermissionError:
        raise ProcessAccessError(pid, path) from None


# -- the walk -----------------------------------------------------------------------------

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FdDir:
    """A process's fd directory, open and listed: what a walk's fd step reads."""

    pid: Pid
    path: str  # /proc/PID/fd, for messages
    fd: int  # the open directory: fds are read relative to it (no path walk per fd)
    entries: list[bytes]  # its fd names, bytes: links come back as bytes, as maps paths do


def walk(
    pid: Pid,
    objects: Callable[[bytes], T],
    fds: Callable[[T, FdDir], bool],
    *,
    maps: str = "maps",
) -> tuple[int, T, bool]:
    """The one way a process is read: `objects(data)` of its /proc/PID/`maps` file, then
    `fds(those objects, its fd directory)`, which returns False when a deadline stopped it
    part way. Returns (pid, objects, complete), `self` resolved. A process gone at any
    step raises ProcessNotFoundError, one this user may not read ProcessAccessError (from
    `objects` and `fds` too); the directory is closed whatever happens."""
    found = objects(read_proc_bytes(pid, f"/proc/{pid}/{maps}"))
    path, dir_fd = open_fd_dir(pid)
    try:
        try:
            entries = os.listdir(os.fsencode(path))
        except GONE:
            raise ProcessNotFoundError(pid) from None
        except PermissionError:
            raise ProcessAccessError(pid, path) from None
        complete = fds(found, FdDir(pid, path, dir_fd, entries))
    finally:
        os.close(dir_fd)
    return (os.getpid() if pid == "self" else pid), found, complete


# -- one process, grouped by object -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessShm:
    """A process's shm fds and VMAs, read together."""

    pid: int
    fds: tuple[ShmFd, ...]
    mappings: tuple[ShmMapping, ...]


def check_readable(pid: int) -> None:
    """Raise ProcessNotFoundError / ProcessAccessError now rather than mid-report; a
    missing process's error says what else can hide one (hidepid, a PID namespace)."""
    if pid <= 0:
        raise ProcessNotFoundError(pid)
    for path in (f"/proc/{pid}/fd", f"/proc/{pid}/maps"):
        try:
            if path.endswith("/fd"):
                os.listdir(path)
            else:  # the fds' links need the same ptrace read access as maps
                with open(path, "rb") as f:
                    f.read(1)
        except GONE:
            raise ProcessNotFoundError(pid, why_not_found(pid)) from None
        except PermissionError:
            raise ProcessAccessError(pid, path) from None


def command_name(pid: Pid) -> str | None:
    """The process's command name (/proc/PID/comm, chosen by the process: escape it
    before printing), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:  # bytes: a "\r" in it stays one
            return f.read().decode(errors="surrogateescape").removesuffix("\n")
    except OSError:
        return None
