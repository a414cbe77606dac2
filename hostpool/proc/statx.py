"""statx(2) of an fd in an open /proc/PID/fd directory, with cached attributes only."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Final

AT_STATX_DONT_SYNC: Final = 0x4000
_STATX_MASK: Final = 0x1 | 0x100 | 0x400  # STATX_TYPE | STATX_INO | STATX_BLOCKS


def stat_fd(dir_fd: int, entry: bytes) -> tuple[int, int, int, int]:
    """(st_mode, st_dev, st_ino, st_blocks) of the object that the fd
    `entry` of an open /proc/PID/fd directory refers to.

    statx(AT_STATX_DONT_SYNC) takes what the kernel has cached: the filesystem is not
    asked to revalidate, so another user's FUSE daemon cannot stall the read by never
    answering, nor a network filesystem by being slow. Plain stat() where libc lacks
    statx. Raises OSError as os.stat does.
    """
    if _statx is None:
        st = os.stat(entry, dir_fd=dir_fd)
        return st.st_mode, st.st_dev, st.st_ino, st.st_blocks
    buf = getattr(_per_thread, "statx", None)
    if buf is None:  # one buffer per thread: scrapes may run side by side
        buf = _per_thread.statx = _Statx()
    if _statx(dir_fd, entry, AT_STATX_DONT_SYNC, _STATX_MASK, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), entry)
    return buf.mode, os.makedev(buf.dev_major, buf.dev_minor), buf.ino, buf.blocks


class _Statx(ctypes.Structure):
    # struct statx (linux/stat.h): the fields read here, the rest padding, 256 bytes
    _fields_ = [
        ("mask", ctypes.c_uint32),
        ("blksize", ctypes.c_uint32),
        ("attributes", ctypes.c_uint64),
        ("nlink", ctypes.c_uint32),
        ("uid", ctypes.c_uint32),
        ("gid", ctypes.c_uint32),
        ("mode", ctypes.c_uint16),
        ("_spare0", ctypes.c_uint16),
        ("ino", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("blocks", ctypes.c_uint64),
        ("attributes_mask", ctypes.c_uint64),
        ("_times", ctypes.c_uint8 * 64),  # atime, btime, ctime, mtime
        ("rdev_major", ctypes.c_uint32),
        ("rdev_minor", ctypes.c_uint32),
        ("dev_major", ctypes.c_uint32),
        ("dev_minor", ctypes.c_uint32),
        ("_rest", ctypes.c_uint8 * 112),
    ]


def _load_statx() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None  # libc without statx (glibc < 2.28)
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                   ctypes.POINTER(_Statx)]  # fmt: skip
    fn.restype = ctypes.c_int
    if fn(-100, b"/", 0, _STATX_MASK, _Statx()) != 0:  # AT_FDCWD; ENOSYS before 4.11
        return None
    return fn


_statx: Any = _load_statx()
_per_thread = threading.local()
