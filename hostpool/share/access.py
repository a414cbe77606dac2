"""Who may connect, and what access each peer gets to a pool: decided by the server.

The danger is a peer shrinking a region under its owner: every later touch of the lost
pages SIGBUSes the owner. So:

- writable access goes only to uids granted it (the server's own uid, which could open
  /proc/PID/fd/N itself anyway, and `writable_uids`), and only for memfds the kernel
  reports sealed against shrinking (F_GET_SEALS, not what the Region recorded);
- hugetlb-backed regions are never shared writable: F_SEAL_SHRINK does not stop
  `fallocate(PUNCH_HOLE)`, and a peer that punches a hole and takes the freed hugepages
  makes the owner's next touch a SIGBUS (normal shmem refaults a fresh page instead).
  Measured on Linux 6.18: the only seal that stops punching while the owner keeps its
  writable mapping, F_SEAL_FUTURE_WRITE, also refuses every new writable mapping, so
  no writable share of a hugetlb region can be made safe (an O_RDONLY fd cannot punch:
  EBADF);
- everything else is read-only: an O_RDONLY fd, which cannot ftruncate, of an inode the
  peer cannot reopen writable through /proc/self/fd/N (owned by this uid, 0600; memfds
  are fchmod-ed so at creation). A region whose mode would let the peer reopen it
  writable is refused to that peer;
- a peer asking for `any` gets what it may have; asking for `write` where that is not
  allowed is refused with the reason, never silently narrowed.

Root and the server's own uid bypass file modes, so for them read-only is a promise the
peer keeps, not a wall: they could reach the memory through /proc/PID/fd anyway.

The other way round, a peer must not be hurt by this server: `attach()` takes fds from a
server of another uid (not root) only sealed against hole punching, since a punched page
the peer touches again is allocated anew and charged to the peer's cgroup. Non-hugetlb
regions are sealed F_SEAL_SEAL at creation without that seal (it would refuse every
writable share), so such peers attach them with `allow_unsealed=True`, accepting it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from dataclasses import dataclass

from hostpool.base.fsmagic import HUGETLBFS_MAGIC
from hostpool.base.fsmagic import fs_magic as fs_magic  # one fstatfs; socketpath imports it here
from hostpool.errors import ShareError

SHRINK_SEAL = fcntl.F_SEAL_SHRINK
F_SEAL_FUTURE_WRITE = 0x10  # not in Python 3.11's fcntl
PUNCH_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE  # what stops fallocate(PUNCH_HOLE)


@dataclass(frozen=True)
class Grant:
    readonly: bool
    reason: str | None = None  # why the access is narrower than the peer asked for
    unsafe: bool = False  # narrowed because a region could be shrunk, not by policy


class AccessPolicy:
    def __init__(self, allowed_uids: Iterable[int], writable_uids: Iterable[int]) -> None:
        self.owner = os.geteuid()
        self.writable = frozenset(writable_uids) | {self.owner}
        self.allowed = frozenset(allowed_uids) | self.writable

    def may_connect(self, uid: int) -> bool:
        return uid in self.allowed

    def decide(self, uid: int, access: str, fds: list[tuple[str, int]]) -> Grant:
        """The access `uid` gets to regions `(name, fd)`; ShareError with the reason if none."""
        if access == "read":
            grant = Grant(readonly=True)
        elif uid not in self.writable:
            if access == "write":
                raise ShareError(
                    f"uid {uid} is not granted write access by this server (writable_uids); "
                    "attach read-only"
                )
            grant = Grant(True, f"uid {uid} is not granted write access")
        else:
            unsafe = next((why for name, fd in fds if (why := shrinkable(name, fd))), None)
            huge = next((why for name, fd in fds if (why := punchable(name, fd))), None)
            if (unsafe or huge) is not None and access == "write":
                raise ShareError(f"writable sharing refused: {unsafe or huge}")
            if unsafe is not None:
                grant = Grant(True, unsafe, unsafe=True)
            else:  # a hugetlb pool is a normal configuration: read-only is not news
                grant = Grant(huge is not None, huge)
        if grant.readonly and uid not in (self.owner, 0):
            for name, fd in fds:
                st = os.fstat(fd)
                if st.st_uid == uid or st.st_mode & 0o022:
                    raise ShareError(
                        f"region {name} (mode {st.st_mode & 0o777:o}, uid {st.st_uid}) could be "
                        f"reopened writable by uid {uid} through /proc/self/fd; not shared"
                    )
        return grant


def shrinkable(name: str, fd: int) -> str | None:
    """Why a peer holding this fd writable could shrink it under its owner, or None."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return (
            f"region {name} is a /dev/shm file, which cannot be sealed: a writable peer could "
            "truncate it and SIGBUS this process"
        )
    if not seals & SHRINK_SEAL:
        return (
            f"region {name} is not sealed against shrinking: a writable peer could truncate "
            "it and SIGBUS this process"
        )
    return None


def is_hugetlb(fd: int) -> bool:
    """Whether `fd` is a file on hugetlbfs (a hugetlb memfd)."""
    return fs_magic(fd) == HUGETLBFS_MAGIC


def punchable(name: str, fd: int) -> str | None:
    """Why this region cannot be shared writable because it is hugetlb, or None: unsealed,
    a writable peer could punch holes and take the pages before the owner refaults them;
    sealed against punching, no new writable mapping of it can be made at all."""
    if not is_hugetlb(fd):
        return None
    try:
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & PUNCH_SEALS
    except OSError:
        sealed = 0
    if sealed:  # hostpool's own hugetlb memfds (memory.shm.seal_mapped)
        return (
            f"region {name} is backed by hugetlb pages and sealed against hole punching "
            "(F_SEAL_FUTURE_WRITE), which also refuses every new writable mapping, so "
            "hugetlb pools are shared read-only"
        )
    return (
        f"region {name} is backed by hugetlb pages: a writable peer could punch a hole "
        "(fallocate) and take the freed hugepages, and this process would SIGBUS at its next "
        "touch; no seal stops that and keeps the region writable, so hugetlb pools are "
        "shared read-only"
    )
