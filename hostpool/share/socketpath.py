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
  That flock is waited on for at most LOCK_TIMEOUT_S (then UnavailableError, naming who
  holds it: in a 1777 directory any user can hold it) and not at all once the caller's
  stop event is set (`shareddir.stop_waits_on`: `Cancelled`).
- The socket is bound in a private directory of this process's own (through
  /proc/self/fd, so the length of its name does not matter), given its mode there, and
  hard-linked into place: nothing is ever chmod-ed by the final path, which a neighbour
  could have swapped for a symlink to another file by then.
- On close only the socket this process bound is removed, recognised by its inode: a
  socket someone else put there since is not ours to delete.
- `check()` finds every problem `listen()` would meet (a path too long for sun_path, a
  directory on a pseudo filesystem such as /proc or read-only, one this uid cannot
  create in, an unsafe directory, something else or a live server at the path) without
  changing anything, so `hostpool serve` refuses before it allocates a page.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import tempfile

from hostpool.base import events, shareddir
from hostpool.errors import ConfigError, ShareError, ShareSocketInUseError, UnavailableError
from hostpool.share.access import fs_magic

PROBE_TIMEOUT = 1.0
# The directory lock is held while probing (at most PROBE_TIMEOUT per socket type) and
# binding: a wait beyond this is a lock nobody will give back.
LOCK_TIMEOUT_S = 10.0
_HINT = "use a directory of this user (or a missing one, which is created private)"
MAX_PATH_BYTES = 107  # sun_path is 108 bytes with its terminating NUL
_BIND_NAME = "s"
_SHORTAGE = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS)
# Filesystems that cannot (or must not) hold a socket file, by statfs f_type.
PSEUDO_FILESYSTEMS = {
    0x9FA0: "procfs",
    0x62656572: "sysfs",
    0x27E0EB: "cgroupfs",
    0x63677270: "cgroup2fs",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0xCAFE4A11: "bpffs",
    0x62656570: "configfs",
    0x6165676C: "pstorefs",
    0xDE5E81E4: "efivarfs",
    0xF97CFF8C: "selinuxfs",
    0x65735543: "fusectl",
    0x6E736673: "nsfs",
}


class SocketPath:
    def __init__(self, path: str, *, open_to_others: bool) -> None:
        self.path = os.path.abspath(path)
        self.directory = os.path.dirname(self.path)
        self.open_to_others = open_to_others
        self._created_dirs: list[str] = []
        self._identity: tuple[int, int] | None = None

    def check(self) -> None:
        """Raise ConfigError (or ShareSocketInUseError) for every problem `listen()` would
        meet, changing nothing: the whole path is looked at, not created."""
        try:
            self._check_length()
            here = self._nearest_existing()
            self._check_filesystem(here)
            if here == self.directory:
                self._check_directory()
            elif not os.access(here, os.W_OK | os.X_OK):
                raise ConfigError(
                    f"share socket directory {self.directory} is missing and this user "
                    f"cannot create it in {here}"
                )
            self._check_existing()
        except OSError as exc:
            raise self._os_error(exc) from exc

    def listen(self, backlog: int) -> socket.socket:
        """Bind and listen at the path; raises ConfigError or ShareSocketInUseError, leaving
        nothing behind."""
        try:
            try:
                self._check_length()
                self._check_filesystem(self._nearest_existing())
                self._make_directories()
                dir_fd = self._open_directory()
                try:
                    if not shareddir.flock_within(dir_fd, fcntl.LOCK_EX, timeout_s=LOCK_TIMEOUT_S):
                        raise UnavailableError(
                            f"share socket directory {self.directory}: its lock is "
                            f"{shareddir.describe_holders(dir_fd)} for more than "
                            f"{LOCK_TIMEOUT_S:g} s; stop that process or choose another "
                            "share socket path"
                        )
                    self._clear_stale()
                    return self._bind(backlog, dir_fd)
                finally:
                    os.close(dir_fd)  # releases the flock
            except OSError as exc:
                raise self._os_error(exc) from exc
        except BaseException:
            self.release()
            raise

    def _os_error(self, exc: OSError) -> ShareError | ConfigError:
        """A typed error naming the path: out of fds or memory is a runtime failure, any
        other refusal (permissions, a read-only or odd filesystem) a configuration one."""
        text = f"share socket {self.path}: {exc.strerror or exc}"
        if exc.filename not in (None, self.path):
            text += f" ({exc.filename})"
        return ShareError(text) if exc.errno in _SHORTAGE else ConfigError(text)

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
    def _check_length(self) -> None:
        length = len(os.fsencode(self.path))
        if length > MAX_PATH_BYTES:
            raise ConfigError(
                f"share socket path {self.path} is {length} bytes; a Unix socket path can "
                f"have at most {MAX_PATH_BYTES}: choose a shorter one"
            )

    def _nearest_existing(self) -> str:
        """The socket's directory, or its nearest ancestor that exists; ConfigError if a
        component is something other than a directory."""
        here = self.directory
        while not os.path.lexists(here):
            here = os.path.dirname(here)
        if not os.path.isdir(here):
            raise ConfigError(f"share socket path {self.path}: {here} is not a directory")
        return here

    def _check_filesystem(self, directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            kind = PSEUDO_FILESYSTEMS.get(fs_magic(fd))
            read_only = os.fstatvfs(fd).f_flag & os.ST_RDONLY
        finally:
            os.close(fd)
        if kind is not None:
            raise ConfigError(
                f"share socket path {self.path}: {directory} is on {kind}, which cannot "
                "hold a socket; choose a path such as /run/hostpool/share.sock"
            )
        if read_only:
            raise ConfigError(
                f"share socket path {self.path}: {directory} is on a read-only filesystem"
            )

    def _check_existing(self) -> None:
        """What is at the path now: nothing, or a stale socket, is fine."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"{self.path} exists and is not a socket; not replacing it")
        if self._answers():
            raise ShareSocketInUseError(
                f"a server is already listening at {self.path}: stop it or choose another "
                "share socket path (it was left untouched)"
            )

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
        os.close(self._open_directory())

    def _open_directory(self) -> int:
        """The directory's fd, checked (shareddir.open_directory); the caller closes it."""
        fd = shareddir.open_directory(self.directory, what="share socket directory", hint=_HINT)
        st = os.fstat(fd)
        if self.open_to_others and not st.st_mode & 0o001:
            events.warning(
                "hostpool.share_directory_closed",
                directory=self.directory,
                mode=f"{stat.S_IMODE(st.st_mode):o}",
                reason="other uids are allowed but cannot traverse this directory; it is "
                "not changed (use a directory with o+x, or a missing one)",
            )
        return fd

    def _clear_stale(self) -> None:
        self._check_existing()
        if not os.path.lexists(self.path):
            return
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

    def _bind(self, backlog: int, dir_fd: int) -> socket.socket:
        """Bind in a private directory, set the mode there, link the socket into place."""
        mode = 0o666 if self.open_to_others else 0o600
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        private = tempfile.mkdtemp(prefix=".hostpool-bind-", dir=self.directory)
        try:
            private_fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                sock.bind(f"/proc/self/fd/{private_fd}/{_BIND_NAME}")
                # SO_PEERCRED is the real gate; the mode keeps other uids from even
                # connecting unless they are allowed. Only this process writes here.
                os.chmod(_BIND_NAME, mode, dir_fd=private_fd)
                st = os.stat(_BIND_NAME, dir_fd=private_fd, follow_symlinks=False)
                try:
                    os.link(
                        _BIND_NAME,
                        os.path.basename(self.path),
                        src_dir_fd=private_fd,
                        dst_dir_fd=dir_fd,
                        follow_symlinks=False,
                    )
                except FileExistsError as exc:
                    # put there by a process that does not take the directory lock
                    raise ShareSocketInUseError(
                        f"{self.path} was taken by another process while starting"
                    ) from exc
                self._identity = (st.st_dev, st.st_ino)
                sock.listen(backlog)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(_BIND_NAME, dir_fd=private_fd)
                os.close(private_fd)
        except BaseException:
            sock.close()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(private)
        return sock
