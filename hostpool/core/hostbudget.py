"""A host-wide budget shared by the rank processes of one host, through a directory.

Each HostBudget owns one reservation file in the directory and holds an `flock` on it for
as long as it lives. The lock is the liveness signal: when a process dies, however it
dies, the kernel drops its locks, so its reservation stops counting. Before reserving,
a process takes the directory lock and sums the files it cannot lock (live peers); files
it can lock belong to the dead and are removed.

Fork: a child shares its parent's open file descriptions, so an inherited lock fd would
keep a SIGKILLed parent's reservation alive for as long as the child lives. Children
close the inherited fds at fork (`os.register_at_fork`) and start with no reservation.

A reservation is what this manager held plus what it asked for at its last admission;
`settle(held)` shrinks it once memory is freed (the next admission does so anyway).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
import weakref
from collections.abc import Iterator

from hostpool.base.units import format_size, parse_size
from hostpool.errors import AllocationError, InvalidRequestError

LOCK_NAME = ".lock"
SUFFIX = ".resv"


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


os.register_at_fork(after_in_child=_after_fork_in_child)


class HostBudget:
    """BudgetPolicy across processes: `HostPoolManager(budget=HostBudget(limit, dir))`."""

    def __init__(self, limit: int | str, directory: str | os.PathLike[str]) -> None:
        self.limit = parse_size(limit, what="host budget")
        if self.limit <= 0:
            raise InvalidRequestError(f"host budget must be positive, got {limit!r}")
        self.directory = os.fspath(directory)
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
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
        with state.lock, self._directory_locked(fcntl.LOCK_EX):
            own = self._own_file(state)
            others, peers = self._peers(own)
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
        with state.lock, self._directory_locked(fcntl.LOCK_SH):
            others, _ = self._peers(state.path, remove_stale=False)
            return others + state.reserved

    # -- beyond the protocol ---------------------------------------------------------
    def settle(self, held: int) -> None:
        """Shrink this process's reservation to what it holds now (after frees)."""
        state = self._state
        with state.lock, self._directory_locked(fcntl.LOCK_EX):
            if state.fd is not None and held < state.reserved:
                self._write(state, max(0, held))

    def close(self) -> None:
        """Give the reservation back now (also done when the budget is collected)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"HostBudget(limit={self.limit}, directory={self.directory!r})"

    # -- internals -------------------------------------------------------------------
    @contextlib.contextmanager
    def _directory_locked(self, mode: int) -> Iterator[None]:
        path = os.path.join(self.directory, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def _own_file(self, state: _Reservation) -> str:
        """This budget's reservation file, created and locked under the directory lock
        (so no peer can take it for stale between creation and lock)."""
        if state.fd is not None and state.path is not None:
            return state.path
        name = f"{os.getpid()}.{secrets.token_hex(6)}{SUFFIX}"
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        state.fd, state.path, state.reserved = fd, path, 0
        return path

    def _peers(self, own: str | None, *, remove_stale: bool = True) -> tuple[int, int]:
        """(bytes reserved by live peers, how many reserve any), removing dead ones' files."""
        total = peers = 0
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if not name.endswith(SUFFIX) or path == own:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # removed meanwhile by its owner
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a live owner holds it
                    reserved = _read_reservation(fd)
                    total += reserved
                    peers += reserved > 0
                    continue
                if remove_stale:  # its owner is gone: its reservation is void
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            finally:
                os.close(fd)
        return total, peers

    def _write(self, state: _Reservation, value: int) -> None:
        assert state.fd is not None
        data = f"{value} {os.getpid()}\n".encode()
        os.pwrite(state.fd, data, 0)
        os.ftruncate(state.fd, len(data))
        state.reserved = value


def _read_reservation(fd: int) -> int:
    """A peer's reserved bytes; an unreadable file counts as nothing reserved."""
    try:
        return int(os.pread(fd, 64, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _b(n: int) -> str:
    return f"{n} bytes ({format_size(n)})"
