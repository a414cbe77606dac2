"""The host scan's bounds: one time budget across its phases, and the rule that keeps its
walks off filesystems that can stall.

Phases, in the order a scan runs them (`PHASES`): `mountinfo` (every mount namespace's
mount table), `processes` (every process's maps and fds), `tmpfs` (the files on every
tmpfs and hugetlbfs mount), `sysv` (/proc/sysvipc/shm). Each checks the `Budget` between
its steps (a process, a chunk of mountinfo, a directory entry); the first phase that
finds it spent is the scan's `truncated_phase`, and every later phase stops at once.

A path to a tmpfs mount is walked only if no mount on the way is of a type outside
`LOCAL_FSTYPES` (`unsafe_on_the_way`): a network or FUSE filesystem that stops answering
would hang any lookup through it (a process in D state, SIGTERM ignored). The list is
of types whose lookups the kernel answers from memory or a local disk; any other type
(fuse.*, nfs, cifs, 9p, ceph, autofs, virtiofs, one not known here) is skipped and the
scan marked incomplete. Mounts below a walked tmpfs directory are never entered (nor
stat-ed: a stat of a mount point asks the filesystem mounted there).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Final, Literal

Phase = Literal["mountinfo", "processes", "tmpfs", "sysv"]
PHASES: Final[tuple[Phase, ...]] = ("mountinfo", "processes", "tmpfs", "sysv")

# filesystems whose lookups never wait on a peer: memory, a local block device, the
# kernel's own pseudo filesystems (overlay: the usual container root, on local layers)
LOCAL_FSTYPES: Final = frozenset({
    "tmpfs", "devtmpfs", "hugetlbfs", "ramfs", "rootfs", "overlay", "ext2", "ext3",
    "ext4", "xfs", "btrfs", "f2fs", "vfat", "exfat", "squashfs", "erofs", "iso9660",
    "zfs", "proc", "sysfs", "devpts", "mqueue", "cgroup", "cgroup2", "bpf", "securityfs",
    "debugfs", "tracefs", "configfs", "pstore", "efivarfs", "binfmt_misc", "nsfs",
    "fusectl", "selinuxfs", "rpc_pipefs", "nfsd",
})  # fmt: skip


class Budget:
    """A scan's time budget: `deadline` a time.monotonic() value (None: unbounded)."""

    __slots__ = ("deadline", "truncated_phase")

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = deadline
        self.truncated_phase: Phase | None = None

    def spent(self, phase: Phase) -> bool:
        """Whether the budget is spent (once it is, for every later check too); the
        first phase to find it so is recorded."""
        if self.truncated_phase is not None:
            return True
        if self.deadline is None or time.monotonic() <= self.deadline:
            return False
        self.truncated_phase = phase
        return True

    @property
    def truncated(self) -> bool:
        return self.truncated_phase is not None


def unsafe_on_the_way(mountpoint: str, unsafe: Collection[str]) -> str | None:
    """The first mount point of `unsafe` (mounts of a type outside LOCAL_FSTYPES, in the
    namespace `mountpoint` is in) that a lookup of `mountpoint` passes through or lands
    on, None if none: `/`, then each of its ancestors, then itself."""
    if not unsafe:
        return None
    if "/" in unsafe:
        return "/"
    at = 0
    while True:
        at = mountpoint.find("/", at + 1)
        prefix = mountpoint if at < 0 else mountpoint[:at]
        if prefix in unsafe:
            return prefix
        if at < 0:
            return None


def below(mountpoint: str, points: Collection[str]) -> frozenset[str]:
    """The mount points of `points` strictly below `mountpoint`, as paths relative to it."""
    base = mountpoint.rstrip("/") + "/"
    return frozenset(p[len(base) :] for p in points if p.startswith(base) and len(p) > len(base))
