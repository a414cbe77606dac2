"""statx(2) of the fds in an open /proc/PID/fd directory, with cached attributes only.

A scan stats every fd of every process it reads (hundreds of thousands per scrape), so
the call is shaped for a hot loop: `FdStat.identity` makes one libc call and one struct
unpack, and gives the object's identity as a tuple that is used as a dict key as is;
the mode and the pages are read from the same buffer only when asked.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any, Final

AT_STATX_DONT_SYNC: Final = 0x4000
_STATX_MASK: Final = 0x1 | 0x100 | 0x400  # STATX_TYPE | STATX_INO | STATX_BLOCKS
_STATX_SIZE: Final = 256  # sizeof(struct statx)
# struct statx (linux/stat.h), native byte order: stx_mode at 28, stx_ino at 32,
# stx_blocks at 48, stx_dev_major and stx_dev_minor at 136 and 140
_IDENTITY: Final = struct.Struct("=32xQ96xII")  # (ino, dev major, dev minor)
_MODE_BLOCKS: Final = struct.Struct("=28xH18xQ")  # (mode, blocks)

Identity = tuple[int, int, int]  # (st_ino, major(st_dev), minor(st_dev))


def identity_of(dev: int, ino: int) -> Identity:
    """The identity `FdStat.identity` gives for an object with this st_dev and st_ino."""
    return ino, os.major(dev), os.minor(dev)


class FdStat:
    """Stats fds of open /proc/PID/fd directories, through their links to the objects.

    statx(AT_STATX_DONT_SYNC) takes what the kernel has cached: the filesystem is not
    asked to revalidate, so another user's FUSE daemon cannot stall the read by never
    answering, nor a network filesystem by being slow. Plain stat() where libc lacks
    statx. One instance per thread: `mode_blocks` reads what the last `identity` call of
    this instance stored.
    """

    __slots__ = ("_buf", "_ref", "_st")

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(_STATX_SIZE)
        self._ref = ctypes.byref(self._buf)
        self._st: os.stat_result | None = None

    def identity(self, dir_fd: int, entry: bytes) -> Identity:
        """(st_ino, major, minor of st_dev) of the object that the fd `entry` of the open
        /proc/PID/fd directory `dir_fd` refers to. Raises OSError as os.stat does
        (FileNotFoundError: the fd was closed since it was listed)."""
        if _statx is None:
            st = self._st = os.stat(entry, dir_fd=dir_fd)
            return identity_of(st.st_dev, st.st_ino)
        if _statx(dir_fd, entry, AT_STATX_DONT_SYNC, _STATX_MASK, self._ref):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), entry)
        return _IDENTITY.unpack_from(self._buf)

    def mode_blocks(self) -> tuple[int, int]:
        """(st_mode, st_blocks) of the object of the last successful `identity` call."""
        if self._st is not None:
            return self._st.st_mode, self._st.st_blocks
        return _MODE_BLOCKS.unpack_from(self._buf)


def _load_statx() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None  # libc without statx (glibc < 2.28)
    # no argtypes: ctypes passes an int as int, bytes as char * and a byref as a pointer
    # as they are, without converting each argument through a declared type
    fn.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if fn(-100, b"/", 0, _STATX_MASK, ctypes.byref(buf)) != 0:  # AT_FDCWD; ENOSYS < 4.11
        return None
    return fn


_statx: Any = _load_statx()
