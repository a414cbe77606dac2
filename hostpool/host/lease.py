"""The kernel's proof that nobody holds a file, and the unlink it guards; the SysV
segment's attach count read right before its IPC_RMID.

A write lease (`fcntl(fd, F_SETLEASE, F_WRLCK)`) is granted only while no other open
file description of the inode exists, in any process of any PID namespace: an fd opened
read-only or read-write, a mapping whose fd was closed, an fd in flight in a Unix socket
(SCM_RIGHTS), a file opened through an overlay whose upper layer is this file (measured
on Linux 6.18: docs/reap.md). So `unlink_unheld` opens the name itself, takes the lease,
unlinks the name while the lease is held, then releases it. An opener that arrives in
between blocks on the lease until it is released (never longer: no lease-break timeout
is waited for) and then holds what it opened. What the lease cannot see, an `O_PATH` fd,
is for the caller's /proc walk (`scan.holders_of`).

A refusal is typed (`Kept`): `kept_held` (the kernel says someone has it open: EAGAIN,
or another process's lease on it), `kept_changed` (not the file planned any more),
`kept_unprovable` (the kernel could not answer: leases disabled or unsupported, not the
file's owner without CAP_LEASE, any other error). Nothing here logs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from typing import Final, Literal

from hostpool.host.model import Identity

F_SETLEASE: Final = 1024
F_GETLEASE: Final = 1025
F_SETSIG: Final = 10
# A lease break signals the lease holder (SIGIO by default, whose default action kills):
# SIGURG's default action is to ignore it, and F_SETOWN 0 right after stops it entirely.
_BREAK_SIGNAL: Final = 23  # SIGURG

KeptOutcome = Literal["kept_held", "kept_changed", "kept_unprovable"]
# (identity, size, mtime_ns, ctime_ns): what must not change between the checks
Seen = tuple[Identity, int, int, int]


def seen(st: os.stat_result) -> Seen:
    """The fields of a stat that say a file is unchanged."""
    return (st.st_dev, st.st_ino), st.st_size, st.st_mtime_ns, st.st_ctime_ns


class Kept(Exception):
    """The file was not unlinked: `outcome`, `detail` for people, `errno` where the
    kernel gave one."""

    def __init__(self, outcome: KeptOutcome, detail: str, code: int | None = None) -> None:
        super().__init__(detail)
        self.outcome: KeptOutcome = outcome
        self.detail = detail
        self.errno = code


@dataclass(frozen=True, slots=True)
class Unlinked:
    """A name removed under the lease: `links_left` hard links of the inode stay;
    `freed_bytes` the pages it had (0 while another link or a late opener keeps them)."""

    links_left: int
    freed_bytes: int
    detail: str = ""


def unlink_unheld(dfd: int, name: str, before: Seen) -> Unlinked:
    """Unlink `name` in directory `dfd` only if it is still the file `before` describes
    and the kernel grants a write lease on it; `Kept` otherwise. OSError for a failure
    of the unlink itself (EROFS, EPERM, ...)."""
    fd = _open(dfd, name, before)
    try:
        _lease(fd)
        try:
            now = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != before[0]:
                raise Kept("kept_changed", "another file took its name while it was leased")
            os.unlink(name, dir_fd=dfd)
            after = os.fstat(fd)
            # an opener that arrived while the lease was held broke it: it holds the pages
            late = fcntl.fcntl(fd, F_GETLEASE) != fcntl.F_WRLCK
        finally:
            _release(fd)
    finally:
        os.close(fd)
    if after.st_nlink > 0:
        return Unlinked(after.st_nlink, 0, f"{after.st_nlink} other hard link(s) keep it")
    if late:
        return Unlinked(0, 0, "opened while it was removed: its opener keeps the pages")
    return Unlinked(0, after.st_blocks * 512)


def _open(dfd: int, name: str, before: Seen) -> int:
    """`name` opened for reading without following it, checked to be the file planned.
    The name is opened `O_PATH` first and checked to be that regular file; only then is
    that very inode reopened for reading (through /proc/self/fd), so a device node or a
    FIFO put in its place is never opened."""
    try:
        path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError as exc:
        raise Kept("kept_changed", "gone since the scan") from exc
    try:
        st = os.fstat(path_fd)
        if not stat.S_ISREG(st.st_mode):
            raise Kept("kept_changed", "no longer a regular file (a symlink or another kind)")
        if seen(st) != before:
            raise Kept("kept_changed", "changed since the scan")
        # no O_NOFOLLOW here: the magic link is followed to the very inode checked
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            return os.open(f"/proc/self/fd/{path_fd}", flags)
        except BlockingIOError as exc:  # another process's lease: it has the file open
            raise Kept(
                "kept_held", "another process holds a lease on it (it has it open)", exc.errno
            ) from exc
        except OSError as exc:
            raise _unprovable("cannot open it to prove it unheld", exc) from exc
    finally:
        os.close(path_fd)


def _lease(fd: int) -> None:
    try:
        fcntl.fcntl(fd, F_SETSIG, _BREAK_SIGNAL)
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_WRLCK)
    except BlockingIOError as exc:
        raise Kept(
            "kept_held",
            "the kernel refused a write lease: a process has it open or mapped",
            exc.errno,
        ) from exc
    except OSError as exc:
        raise _unprovable("the kernel could not lease it", exc) from exc
    fcntl.fcntl(fd, fcntl.F_SETOWN, 0)


def _release(fd: int) -> None:
    with contextlib.suppress(OSError):  # the close that follows releases it too
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)


def _unprovable(what: str, exc: OSError) -> Kept:
    code = exc.errno or errno.EIO
    why = exc.strerror or os.strerror(code)
    if code == errno.EACCES:
        why = "not its owner and no CAP_LEASE"
    elif code == errno.EINVAL:
        why = "leases unsupported here (fs.leases-enable 0, or this filesystem)"
    name = errno.errorcode.get(code, str(code))
    return Kept("kept_unprovable", f"{what} ({name}: {why})", code)


# -- SysV --------------------------------------------------------------------------------

_IPC_RMID: Final = 0
_IPC_STAT: Final = 2


class _ShmidDs(ctypes.Structure):
    """`struct shmid_ds` of 64-bit Linux (x86_64, aarch64): `ipc_perm` is 48 bytes,
    its key the first int."""

    _fields_ = [
        ("key", ctypes.c_int32),
        ("_perm", ctypes.c_byte * 44),
        ("shm_segsz", ctypes.c_size_t),
        ("shm_atime", ctypes.c_long),
        ("shm_dtime", ctypes.c_long),
        ("shm_ctime", ctypes.c_long),
        ("shm_cpid", ctypes.c_int32),
        ("shm_lpid", ctypes.c_int32),
        ("shm_nattch", ctypes.c_ulong),
        ("_unused", ctypes.c_ulong * 2),
    ]


@dataclass(frozen=True, slots=True)
class SegmentNow:
    """A segment as `shmctl(IPC_STAT)` reads it now."""

    key: int
    size: int
    nattch: int
    changed: int  # the last attach, detach or change (seconds since the epoch)


def segment_now(shmid: int) -> SegmentNow | None:
    """`IPC_STAT` of `shmid`: None if it is gone; OSError for any other refusal."""
    ds = _ShmidDs()
    if _libc.shmctl(shmid, _IPC_STAT, ctypes.byref(ds)) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.EIDRM):
            return None
        raise OSError(code, os.strerror(code))
    changed = max(ds.shm_atime, ds.shm_dtime, ds.shm_ctime)
    return SegmentNow(ds.key, ds.shm_segsz, ds.shm_nattch, changed)


def remove_segment(shmid: int) -> bool:
    """`IPC_RMID`: False if the segment is gone; OSError for any other refusal."""
    if _libc.shmctl(shmid, _IPC_RMID, None) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.EIDRM):
            return False
        raise OSError(code, os.strerror(code))
    return True


_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
