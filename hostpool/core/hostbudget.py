"""A host-wide budget shared by the rank processes of one host, through a directory.

Each HostBudget owns one reservation file in the directory and holds an `flock` on it for
as long as it lives. The lock is the liveness signal: when a process dies, however it
dies, the kernel drops its locks, so its reservation stops counting. Before reserving,
a process takes the directory lock and sums the files it cannot lock (live peers); files
it can lock belong to the dead and are removed.

Fork: a child shares its parent's open file descriptions, so an inherited lock fd would
keep a SIGKILLed parent's reservation alive for as long as the child lives. Children
close the inherited fds at fork (its hook in `hostpool.base.fork`) and start with no
reservation.

A reservation is what this manager held plus what it asked for at its last admission;
`settle(held)` shrinks it once memory is freed (the next admission does so anyway).

The directory is shared, so it is trusted only as `hostpool.base.shareddir` allows (this
uid's or root's; others may write only with the sticky bit), checked on the fd every
operation then uses. In it only regular files of this uid or root count: another user's
file (or a FIFO, a symlink) is neither read nor removed, so nobody can inflate the
reservations or block a reader. The directory lock is waited on for at most
`lock_timeout_s` (an AllocationError with reason `budget` naming who holds it), and not
at all once the caller's stop event is set (`shareddir.stop_waits_on`: `Cancelled`).
What only reads or trims (`reserved_bytes` at scrape, `settle`) never waits long and
never raises for the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import threading
import weakref
from collections.abc import Iterator

from hostpool.base import events, fork, shareddir
from hostpool.base.units import format_size, parse_size
from hostpool.errors import AllocationError, Cancelled, ConfigError, InvalidRequestError

LOCK_NAME = ".lock"
SUFFIX = ".resv"
# How long an admission waits for the directory lock; a peer holds it only while it sums
# the reservation files, so a longer wait means a stopped peer or a stranger's lock.
LOCK_TIMEOUT_S = 10.0
# What a scrape (`reserved_bytes`) or a trim (`settle`) waits before giving up quietly.
READ_TIMEOUT_S = 0.5
_HINT = "use a directory of this user (server.budget_dir), or a missing one"
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class _Reservation:
    """The per-budget state the fork hook and the finalizer act on (never the budget)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.path: str | None = None
        self.reserved = 0

    def drop(self, *, unlink: bool) -> None:
        fd, path = self.fd, self.path
        self.fd, self.path, self.reserved = None, None, 0
        if unlink and path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


_reservations: weakref.WeakSet[_Reservation] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The child must neither keep the parent's locks alive nor remove the parent's file.
    for r in list(_reservations):
        r.lock = threading.Lock()  # another parent thread may have held it at fork
        r.drop(unlink=False)


fork.on_fork(__name__, after_in_child=_after_fork_in_child)


class HostBudget:
    """BudgetPolicy across processes: `HostPoolManager(budget=HostBudget(limit, dir))`."""

    def __init__(
        self,
        limit: int | str,
        directory: str | os.PathLike[str],
        *,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
    ) -> None:
        """ConfigError when the directory is unsafe (another uid's, or writable by others
        without the sticky bit); InvalidRequestError when it cannot be made or opened."""
        self.limit = parse_size(limit, what="host budget")
        if self.limit <= 0:
            raise InvalidRequestError(f"host budget must be positive, got {limit!r}")
        self.directory = os.fspath(directory)
        self.lock_timeout_s = lock_timeout_s
        self._last_others = 0  # what peers reserved at the last read (for a busy scrape)
        self._busy_told = False
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            os.close(self._open_directory())
        except OSError as exc:
            raise InvalidRequestError(
                f"host budget directory {self.directory}: {exc.strerror}"
            ) from exc
        self._state = _Reservation()
        _reservations.add(self._state)
        self._finalizer = weakref.finalize(self, self._state.drop, unlink=True)

    # -- BudgetPolicy ----------------------------------------------------------------
    def limit_bytes(self) -> int:
        return self.limit

    def admit(self, need: int, held: int) -> None:
        """Reserve `held + need` host-wide, or raise AllocationError(reason="budget")."""
        state = self._state
        with state.lock, self._directory_locked(fcntl.LOCK_EX, need) as dir_fd:
            assert dir_fd is not None  # waited with a deadline: locked, or raised
            own = self._own_file(state, dir_fd)
            others, peers = self._peers(dir_fd, own)
            if others + held + need > self.limit:
                raise AllocationError(
                    f"host budget refused: need {_b(need)} with {_b(held)} already held by "
                    f"this process; {peers} other process(es) on this host reserve "
                    f"{_b(others)}; host budget {_b(self.limit)} (shared through "
                    f"{self.directory})",
                    reason="budget",
                    need_bytes=need,
                    available_bytes=max(0, self.limit - others - held),
                    limit_bytes=self.limit,
                )
            self._write(state, held + need)

    def reserved_bytes(self) -> int:
        """Bytes reserved on this host, this process's reservation included."""
        state = self._state
        if not state.lock.acquire(timeout=READ_TIMEOUT_S):
            return self._last_others + state.reserved  # an admission waits for the lock
        try:
            with self._directory_locked(fcntl.LOCK_SH, None) as dir_fd:
                if dir_fd is not None:
                    self._last_others, _ = self._peers(dir_fd, state.path, remove_stale=False)
        except (OSError, ConfigError):
            pass  # a scrape shows the last reading; the next admission raises it, typed
        finally:
            state.lock.release()
        return self._last_others + state.reserved

    # -- beyond the protocol ---------------------------------------------------------
    def settle(self, held: int) -> None:
        """Shrink this process's reservation to what it holds now (after frees)."""
        state = self._state
        if state.fd is None or held >= state.reserved:
            return
        with (
            contextlib.suppress(Cancelled),  # a stop: the reservation goes with the process
            state.lock,
            self._directory_locked(fcntl.LOCK_EX, None) as dir_fd,
        ):
            if dir_fd is not None and state.fd is not None and held < state.reserved:
                self._write(state, max(0, held))

    def close(self) -> None:
        """Give the reservation back now (also done when the budget is collected)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"HostBudget(limit={self.limit}, directory={self.directory!r})"

    # -- internals -------------------------------------------------------------------
    def _open_directory(self) -> int:
        return shareddir.open_directory(self.directory, what="host budget directory", hint=_HINT)

    @contextlib.contextmanager
    def _directory_locked(self, mode: int, need: int | None) -> Iterator[int | None]:
        """The checked directory's fd with its lock held. For an admission (`need` given)
        the lock is waited on for `lock_timeout_s`, then refused; otherwise for at most
        READ_TIMEOUT_S, after which None is yielded (the caller makes do without)."""
        dir_fd = self._open_directory()
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | _FILE_FLAGS, 0o600, dir_fd=dir_fd)
            try:
                st = os.fstat(fd)
                if not shareddir.owned_here(st) or not stat.S_ISREG(st.st_mode):
                    raise ConfigError(
                        f"host budget lock {self._lock_path()} is not a file of this user "
                        f"(uid {st.st_uid}): {_HINT}"
                    )
                timeout = self.lock_timeout_s if need is not None else READ_TIMEOUT_S
                if shareddir.flock_within(fd, mode, timeout_s=timeout):
                    self._busy_told = False
                    yield dir_fd
                    return
                if need is None:
                    if self._busy_told:  # once while it stays busy, not at every scrape
                        yield None
                        return
                    self._busy_told = True
                    events.warning(
                        "hostpool.host_budget_busy",
                        lock=self._lock_path(),
                        held_by=shareddir.describe_holders(fd),
                        action="other processes' reservations are the last ones read",
                    )
                    yield None
                    return
                raise AllocationError(
                    f"host budget refused: its lock {self._lock_path()} is "
                    f"{shareddir.describe_holders(fd)} for more than {timeout:g} s; a "
                    "stopped peer holds it, or another user took it: " + _HINT,
                    reason="budget",
                    need_bytes=need,
                    limit_bytes=self.limit,
                )
            finally:
                os.close(fd)  # closing drops the flock
        finally:
            os.close(dir_fd)

    def _lock_path(self) -> str:
        return os.path.join(self.directory, LOCK_NAME)

    def _own_file(self, state: _Reservation, dir_fd: int) -> str:
        """This budget's reservation file, created and locked under the directory lock
        (so no peer can take it for stale between creation and lock)."""
        if state.fd is not None and state.path is not None:
            return state.path
        name = f"{os.getpid()}.{secrets.token_hex(6)}{SUFFIX}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _FILE_FLAGS
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
            raise
        state.fd, state.path, state.reserved = fd, os.path.join(self.directory, name), 0
        return state.path

    def _peers(self, dir_fd: int, own: str | None, *, remove_stale: bool = True) -> tuple[int, int]:
        """(bytes reserved by live peers, how many reserve any), removing dead ones' files.
        Only regular files of this uid or root count; anything else is left alone."""
        own_name = os.path.basename(own) if own is not None else None
        total = peers = 0
        for name in os.listdir(dir_fd):
            if not name.endswith(SUFFIX) or name == own_name:
                continue
            try:
                fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue  # removed meanwhile by its owner, a symlink (ELOOP), unreadable
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or not shareddir.owned_here(st):
                    continue  # not a reservation: someone else's file, or a FIFO
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a live owner holds it
                    reserved = _read_reservation(fd)
                    total += reserved
                    peers += reserved > 0
                    continue
                if remove_stale:  # its owner is gone: its reservation is void
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
            finally:
                os.close(fd)
        return total, peers

    def _write(self, state: _Reservation, value: int) -> None:
        assert state.fd is not None
        data = f"{value} {os.getpid()}\n".encode()
        os.pwrite(state.fd, data, 0)
        os.ftruncate(state.fd, len(data))
        state.reserved = value


def check_directory(directory: str | os.PathLike[str]) -> None:
    """ConfigError where HostBudget would refuse `directory` (it exists and is another
    user's, or writable by others without the sticky bit); creates nothing (for
    `serve --check`)."""
    path = os.fspath(directory)
    try:
        os.close(shareddir.open_directory(path, what="host budget directory", hint=_HINT))
    except FileNotFoundError:
        return  # made private when the budget starts
    except OSError as exc:
        raise ConfigError(f"host budget directory {path}: {exc.strerror}") from exc


def _read_reservation(fd: int) -> int:
    """A peer's reserved bytes; an unreadable file counts as nothing reserved."""
    try:
        return int(os.pread(fd, 64, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _b(n: int) -> str:
    return f"{n} bytes ({format_size(n)})"
