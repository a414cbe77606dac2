"""Who may connect, and what access each peer gets to a pool: decided by the server.

The danger is a peer shrinking a region under its owner: every later touch of the lost
pages SIGBUSes the owner. So:

- writable access goes only to uids granted it (the server's own uid, which could open
  /proc/PID/fd/N itself anyway, and `writable_uids`), and only for memfds the kernel
  reports sealed against shrinking (F_GET_SEALS, not what the Region recorded);
- everything else is read-only: an O_RDONLY fd, which cannot ftruncate, of an inode the
  peer cannot reopen writable through /proc/self/fd/N (owned by this uid, 0600; memfds
  are fchmod-ed so at creation). A region whose mode would let the peer reopen it
  writable is refused to that peer;
- a peer asking for `any` gets what it may have; asking for `write` where that is not
  allowed is refused with the reason, never silently narrowed.

Root and the server's own uid bypass file modes, so for them read-only is a promise the
peer keeps, not a wall: they could reach the memory through /proc/PID/fd anyway.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from dataclasses import dataclass

from hostpool.errors import ShareError

SHRINK_SEAL = fcntl.F_SEAL_SHRINK


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
            if unsafe is not None and access == "write":
                raise ShareError(f"writable sharing refused: {unsafe}")
            grant = Grant(unsafe is not None, unsafe, unsafe is not None)
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
