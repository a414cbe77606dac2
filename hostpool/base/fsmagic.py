"""Which filesystem a file descriptor is on: fstatfs's `f_type` (Python's os has no
fstatfs; `os.statvfs` has no type). Asked of the open fd itself, so the answer is about
the object in hand, not about a path that may have changed since."""

from __future__ import annotations

import ctypes
import os
from typing import Final

TMPFS_MAGIC: Final = 0x01021994
HUGETLBFS_MAGIC: Final = 0x958458F6
_STATFS_BYTES: Final = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first

_libc = ctypes.CDLL(None, use_errno=True)


def fs_magic(fd: int) -> int:
    """The f_type of the filesystem `fd` is on (an O_PATH fd will do); OSError if the
    call fails."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF
