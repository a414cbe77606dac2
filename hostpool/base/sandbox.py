"""What a process may do after it starts: its user, its capabilities, no_new_privs, the
signal it gets when its parent dies, and a seccomp filter that lets it read the host and
not write to it.

The two sides of `hostpool exporter` call these once, before any thread starts:

- `drop_to_user(uid, gid)`: the side that listens. Where this process may change its
  user (root, or CAP_SETUID/CAP_SETGID), it becomes `uid`/`gid` (real, effective and
  saved; no supplementary groups), every capability gone: the bounding set emptied
  (while CAP_SETPCAP still allows), the ambient set cleared, then the kernel clears the
  permitted and effective sets at the uid change and `capset` the inheritable one.
  Elsewhere (a test, a laptop) it stays who it is and still drops what it holds.
- `keep_only(caps)`: the side that reads. Every capability but `caps` leaves the
  bounding (where allowed), ambient, inheritable, permitted and effective sets; those of
  `caps` it does not hold stay absent (a non-root run keeps none).
- `answerable_to(uid)`: the reading side lets the listener's uid signal it (its saved
  uid), so that the listener can kill it and the kernel's parent-death signal, sent with
  the dying listener's credentials, is not refused.
- `no_new_privs()`, `not_dumpable()`, `die_with_parent(pid)`: prctl's.
- `read_only_filter()` (`hostpool.base.readonly`): the seccomp filter.

`enter_reader()` and `enter_listener(uid, gid)` are the two sides' whole sequences.

Capabilities go through `capget`/`capset` and `prctl` by ctypes: the standard library
has neither, and python-prctl needs libcap's headers to build (the image has none).
`state()` reads back what /proc/self/status says of this process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal

# linux/capability.h
CAP_DAC_READ_SEARCH = 2
CAP_SETGID = 6
CAP_SETUID = 7
CAP_SETPCAP = 8
CAP_SYS_PTRACE = 19
READER_CAPS = frozenset({CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH})
_VERSION_3 = 0x20080522

# linux/prctl.h
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4


class _Header(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _Data(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(OSError):
    """A step of the sandbox failed: the process must not go on with more than it asked."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SandboxError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg2: int = 0, arg3: int = 0, what: str = "prctl") -> int:
    result = int(
        _libc.prctl(
            ctypes.c_int(option),
            ctypes.c_ulong(arg2),
            ctypes.c_ulong(arg3),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )
    )
    if result < 0:
        _check(result, what)
    return result


def last_cap() -> int:
    """The highest capability number this kernel knows."""
    with open("/proc/sys/kernel/cap_last_cap", "rb") as f:
        return int(f.read())


def _mask(caps: frozenset[int]) -> int:
    return sum(1 << cap for cap in caps)


def capabilities() -> tuple[int, int, int]:
    """(effective, permitted, inheritable) of this thread, as 64-bit masks."""
    header = _Header(_VERSION_3, 0)
    data = (_Data * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    effective, permitted, inheritable = (
        int(getattr(data[0], name)) | int(getattr(data[1], name)) << 32
        for name in ("effective", "permitted", "inheritable")
    )
    return effective, permitted, inheritable


def _capset(effective: int, permitted: int, inheritable: int) -> None:
    header = _Header(_VERSION_3, 0)
    data = (_Data * 2)()
    for i in range(2):
        shift = 32 * i
        data[i].effective = (effective >> shift) & 0xFFFFFFFF
        data[i].permitted = (permitted >> shift) & 0xFFFFFFFF
        data[i].inheritable = (inheritable >> shift) & 0xFFFFFFFF
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _drop_bounding(keep: frozenset[int]) -> None:
    """Every capability but `keep` out of the bounding set, where CAP_SETPCAP allows."""
    effective, _permitted, _inheritable = capabilities()
    if not effective & (1 << CAP_SETPCAP):
        return  # an unprivileged process cannot, and its bounding set gives it nothing
    for cap in range(last_cap() + 1):
        if cap not in keep and _prctl(PR_CAPBSET_READ, cap, what="PR_CAPBSET_READ") == 1:
            _prctl(PR_CAPBSET_DROP, cap, what=f"PR_CAPBSET_DROP {cap}")


def _clear_ambient() -> None:
    try:
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, what="PR_CAP_AMBIENT_CLEAR_ALL")
    except SandboxError as exc:
        if exc.errno != errno.EINVAL:  # a kernel before 4.3 has no ambient set
            raise


def keep_only(caps: frozenset[int]) -> None:
    """Hold at most `caps`: the others leave every set (bounding where allowed)."""
    _drop_bounding(caps)
    _clear_ambient()
    _effective, permitted, _inheritable = capabilities()
    kept = permitted & _mask(caps)
    _capset(kept, kept, 0)


def drop_to_user(uid: int, gid: int) -> None:
    """Become `uid`:`gid` with no capability at all where this process may change its
    user; else stay this user with none (see the module's docstring)."""
    _drop_bounding(frozenset())
    _clear_ambient()
    effective, _permitted, _inheritable = capabilities()
    may_change = effective & (1 << CAP_SETUID) and effective & (1 << CAP_SETGID)
    if may_change and (os.getuid(), os.geteuid()) != (uid, uid):
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _capset(0, 0, 0)  # a uid change from 0 leaves the inheritable set: cleared here
    if any(capabilities()):
        raise SandboxError(errno.EPERM, "capabilities left after dropping them all")


def no_new_privs() -> None:
    """No execve from here on gains a privilege (setuid bits, file capabilities)."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1, what="PR_SET_NO_NEW_PRIVS")


def not_dumpable() -> None:
    """No core dump, and /proc/self and ptrace only for CAP_SYS_PTRACE: another process
    of the same uid (uid 65534 is often shared) cannot read this one's memory."""
    _prctl(PR_SET_DUMPABLE, 0, what="PR_SET_DUMPABLE")


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """`sig` to this process when its parent ends, whoever's uid the parent has then
    (the kernel sends it, not the parent); exits at once when the parent `parent` has
    already ended."""
    _prctl(PR_SET_PDEATHSIG, int(sig), what="PR_SET_PDEATHSIG")
    if os.getppid() != parent:
        os._exit(0)


STATUS_FIELDS = (
    "Uid",
    "Gid",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
    "Seccomp",
)


def state(pid: int | str = "self") -> dict[str, str]:
    """The lines of /proc/PID/status that say what a process may do (STATUS_FIELDS)."""
    with open(f"/proc/{pid}/status", "rb") as f:
        text = f.read().decode("ascii", "replace")
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in STATUS_FIELDS:
            found[name] = " ".join(value.split())
    return found


def answerable_to(uid: int) -> None:
    """Let processes of `uid` signal this one: its saved uid becomes `uid` (the kernel
    lets a sender signal a process whose real or saved uid is the sender's), its real and
    effective uids and its capabilities stay (one of its uids stays 0). Without
    CAP_SETUID nothing changes: then the two are one user anyway.

    Why: the parent-death signal is sent with the dying parent's credentials, and a
    SIGKILL from an unprivileged listener to a root reader would be refused: the reader
    would outlive the listener."""
    effective, _permitted, _inheritable = capabilities()
    if effective & (1 << CAP_SETUID):
        os.setresuid(-1, -1, uid)


def enter_reader(listener_uid: int | None = None) -> None:
    """The exporter's reading side, before its first scan: answerable to the listener's
    uid (when given), CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH at most, no_new_privs, the
    read-only seccomp filter."""
    from hostpool.base import readonly

    if listener_uid is not None:
        answerable_to(listener_uid)
    keep_only(READER_CAPS)
    no_new_privs()
    readonly.read_only_filter()


def enter_listener(uid: int, gid: int) -> None:
    """The exporter's listening side, before it serves: `uid`:`gid` where it may change
    user, no capability, no_new_privs, not dumpable."""
    drop_to_user(uid, gid)
    no_new_privs()
    not_dumpable()
