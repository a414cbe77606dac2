"""The share socket's place in the filesystem: claimed carefully, given back exactly.

- Missing directories are created private (0700, or 0711 when other uids may connect:
  traverse only) and removed on close, if still empty. An existing directory is never
  chmod-ed: `--share-socket /var/tmp/x.sock` must leave /var/tmp 1777. It must belong to
  this uid or root and must not let others replace the socket (writable by group or
  others only with the sticky bit).
- A socket already at the path is probed: a server answering there is a
  ShareSocketInUseError and is left alone; only a socket nobody listens on (stale, from a
  dead server) is removed. The probe, the unlink and bind+listen happen under an flock of
  the directory, so two servers starting at once cannot both decide the path is stale.
- On close only the socket this process bound is removed, recognised by its inode: a
  socket someone else put there since is not ours to delete.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat

from hostpool import events
from hostpool.errors import ConfigError, ShareSocketInUseError

PROBE_TIMEOUT = 1.0


class SocketPath:
    def __init__(self, path: str, *, open_to_others: bool) -> None:
        self.path = os.path.abspath(path)
        self.directory = os.path.dirname(self.path)
        self.open_to_others = open_to_others
        self._created_dirs: list[str] = []
        self._identity: tuple[int, int] | None = None

    def listen(self, backlog: int) -> socket.socket:
        """Bind and listen at the path; raises ConfigError or ShareSocketInUseError, leaving
        nothing behind."""
        try:
            self._make_directories()
            self._check_directory()
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX)
                self._clear_stale()
                return self._bind(backlog)
            finally:
                os.close(dir_fd)  # releases the flock
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Remove the socket this process bound (if it is still the one there) and the
        directories it created (if empty)."""
        if self._identity is not None:
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._identity:
                    os.unlink(self.path)
            self._identity = None
        for directory in reversed(self._created_dirs):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        self._created_dirs = []

    # -- steps -----------------------------------------------------------------------
    def _make_directories(self) -> None:
        missing = []
        here = self.directory
        while not os.path.isdir(here):
            missing.append(here)
            here = os.path.dirname(here)
        mode = 0o711 if self.open_to_others else 0o700
        for directory in reversed(missing):
            try:
                os.mkdir(directory, mode)
            except FileExistsError:
                continue  # made by someone else meanwhile: theirs, checked as existing
            self._created_dirs.append(directory)
            # mkdir's mode is masked by the umask; this directory is ours to set exactly.
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def _check_directory(self) -> None:
        st = os.stat(self.directory)
        me = os.geteuid()
        if st.st_uid not in (me, 0):
            raise ConfigError(
                f"share socket directory {self.directory} belongs to uid {st.st_uid}: use a "
                "directory of this user (or a missing one, which is created private)"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(
                f"share socket directory {self.directory} is writable by others without the "
                f"sticky bit (mode {stat.S_IMODE(st.st_mode):o}): another user could replace "
                "the socket; use a private directory"
            )
        if self.open_to_others and not st.st_mode & 0o001:
            events.warning(
                "hostpool.share_directory_closed",
                directory=self.directory,
                mode=f"{stat.S_IMODE(st.st_mode):o}",
                reason="other uids are allowed but cannot traverse this directory; it is "
                "not changed (use a directory with o+x, or a missing one)",
            )

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"{self.path} exists and is not a socket; not replacing it")
        if self._answers():
            raise ShareSocketInUseError(
                f"a server is already listening at {self.path}: stop it or choose another "
                "path (it was left untouched)"
            )
        try:
            os.unlink(self.path)
        except OSError as exc:
            raise ConfigError(
                f"cannot remove the stale socket {self.path}: {exc.strerror}"
            ) from exc
        events.info("hostpool.share_stale_socket_removed", path=self.path)

    def _answers(self) -> bool:
        """Whether something accepts connections at the path (any socket type)."""
        for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM, socket.SOCK_DGRAM):
            probe = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
            probe.settimeout(PROBE_TIMEOUT)
            try:
                probe.connect(self.path)
            except ConnectionRefusedError:
                return False  # a socket file nobody listens on
            except OSError as exc:
                if exc.errno == errno.EPROTOTYPE:
                    continue  # a live socket of another type: try that type
                if isinstance(exc, (TimeoutError, BlockingIOError)):
                    return True  # a live server with a full backlog
                raise ConfigError(f"cannot probe the socket at {self.path}: {exc}") from exc
            else:
                return True
            finally:
                probe.close()
        return False

    def _bind(self, backlog: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            try:
                sock.bind(self.path)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                # bound by a process that does not take the directory lock
                raise ShareSocketInUseError(
                    f"{self.path} was taken by another process while starting"
                ) from exc
            st = os.lstat(self.path)
            self._identity = (st.st_dev, st.st_ino)
            # SO_PEERCRED is the real gate; the mode keeps other uids from even connecting
            # unless they are allowed.
            os.chmod(self.path, 0o666 if self.open_to_others else 0o600)
            sock.listen(backlog)
        except BaseException:
            sock.close()
            raise
        return sock
