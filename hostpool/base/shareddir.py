"""Directories that processes share, and the flocks taken in them.

- A shared directory (the share socket's, the host budget's) must belong to this uid or
  root and must not let others replace what is in it: writable by group or others only
  with the sticky bit. `open_directory` opens it without following a symlink (its last
  component: a symlink another user planted where the directory should be, pointing to
  a directory of root's, is refused, not followed) and checks the directory it opened
  (fstat on the fd), so what was checked is what the caller then uses through that fd: a
  path swapped for a symlink after the check cannot redirect it.
- A flock in such a directory can be held by a process that never lets go: a stopped
  peer, or another uid where the directory is world-writable and sticky. `flock_within`
  waits with a deadline (polling `LOCK_NB`) and gives up at once when the stop event of
  its context (`stop_waits_on`) is set. A blocking `flock` cannot be used: Python retries
  it after a signal handler returns (PEP 475), so a SIGTERM could never end the wait.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Iterator

from hostpool.errors import Cancelled, ConfigError

# Between LOCK_NB tries: short at first (an uncontended lock is taken at the first try, a
# briefly held one soon after), then at most this long, so a stop is seen within it.
POLL_MAX_S = 0.05
_POLL_FIRST_S = 0.001

_stop: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "hostpool_shareddir_stop", default=None
)


@contextlib.contextmanager
def stop_waits_on(event: threading.Event) -> Iterator[None]:
    """Lock waits started in this context raise `Cancelled` soon after `event` is set."""
    token = _stop.set(event)
    try:
        yield
    finally:
        _stop.reset(token)


def check_directory(st: os.stat_result, path: str, *, what: str, hint: str) -> None:
    """ConfigError unless the directory `st` describes belongs to this uid or root and
    lets nobody else replace its entries (group/other write only with the sticky bit)."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(f"{what} {path} belongs to uid {st.st_uid}: {hint}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"{what} {path} is writable by others without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):o}): another user could replace what is in it; {hint}"
        )


def open_directory(path: str, *, what: str, hint: str) -> int:
    """An fd of the directory at `path` (O_RDONLY|O_DIRECTORY|O_NOFOLLOW|O_CLOEXEC) once
    `check_directory` accepts it; the caller closes it. ConfigError when `path` is a
    symlink (whoever made it chose where it points); OSError if it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            _refuse_symlink(path, what=what, hint=hint)
        raise
    try:
        check_directory(os.fstat(fd), path, what=what, hint=hint)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse_symlink(path: str, *, what: str, hint: str) -> None:
    """ConfigError when `path` is a symlink now (else nothing: the caller's error stands)."""
    try:
        st = os.lstat(path)
        target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    except OSError:
        return
    if target is not None:
        raise ConfigError(
            f"{what} {path} is a symlink (of uid {st.st_uid}) to {target!r}: refused, not "
            f"followed; {hint}"
        )


def owned_here(st: os.stat_result) -> bool:
    """Whether a file in a shared directory was made by this uid or root (so may be read
    as one of ours, or removed)."""
    return st.st_uid in (os.geteuid(), 0)


def flock_within(fd: int, mode: int, *, timeout_s: float) -> bool:
    """Take `flock(fd, mode)` (LOCK_SH or LOCK_EX), waiting at most `timeout_s`: True once
    taken, False when the deadline passed. Raises `Cancelled` when the stop event of this
    context is set meanwhile."""
    stop = _stop.get()
    deadline = time.monotonic() + timeout_s
    pause = _POLL_FIRST_S
    while True:
        if stop is not None and stop.is_set():
            raise Cancelled("stopped while waiting for a lock")
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        wait = min(pause, left)
        if stop is not None:
            stop.wait(wait)
        else:
            time.sleep(wait)
        pause = min(pause * 2, POLL_MAX_S)


def flock_holders(fd: int) -> list[int]:
    """The pids /proc/locks shows holding a flock on the file of `fd` (waiters excluded;
    the pid is the one that took the lock). Empty when /proc/locks cannot be read."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders: list[int] = []
    try:
        with open("/proc/locks", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return holders
    for line in text.split("\n"):
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF"; waiters have "->" after "1:"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == ident:
            with contextlib.suppress(ValueError):
                holders.append(int(fields[4]))
    return holders


def describe_holders(fd: int) -> str:
    """`held by pid N (uid U)` for an error message, or `held by another process`."""
    parts = []
    for pid in flock_holders(fd):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            parts.append(f"pid {pid} (uid {uid})")
        except OSError:
            parts.append(f"pid {pid}")
    return "held by " + (", ".join(parts) if parts else "another process")
