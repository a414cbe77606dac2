"""One deadline for a whole attach, shared by every socket operation of it."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from hostpool.errors import ShareError
from hostpool.share import protocol


class AttachDeadline:
    """One deadline for a whole attach: every socket operation gets only what is left, so
    a server trickling packets cannot hold the caller past `timeout`."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.end = time.monotonic() + timeout

    def left(self) -> float:
        """Seconds left; raises the expired ShareError when none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def arm(self, sock: socket.socket) -> None:
        """Give `sock`'s next operation only the time left."""
        sock.settimeout(self.left())

    def connect(self, sock: socket.socket) -> None:
        """Connect, waiting for room in a full backlog until the deadline. (With a socket
        timeout set, a Unix connect to a full backlog fails at once with EAGAIN; blocking,
        it waits up to SO_SNDTIMEO.)"""
        left = self.left()
        sock.settimeout(None)
        whole = int(left)
        wait = struct.pack("ll", whole, max(1, int((left - whole) * 1e6)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, wait)
        try:
            sock.connect(self.path)
        except BlockingIOError as exc:
            raise self.expired() from exc
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
            # Name the path: "[Errno 2] No such file or directory" alone says nothing.
            raise ShareError(
                f"cannot attach to {self.path}: {exc.strerror} (is `hostpool serve "
                "--share-socket` running with this path?)"
            ) from exc
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))

    def expired(self) -> ShareError:
        """The error of an attach that ran out of time."""
        return ShareError(f"attach to {self.path} did not complete within {self.timeout} s")

    def receive(
        self, sock: socket.socket, *, max_fds: int = 0
    ) -> tuple[dict[str, Any], list[int], int]:
        """One reply (message, fds, flags) within the time left; a malformed one, or none
        in time, is a ShareError."""
        self.arm(sock)
        try:
            return protocol.receive(sock, max_fds=max_fds)
        except TimeoutError as exc:
            raise self.expired() from exc
        except protocol.ProtocolError as exc:
            raise ShareError(f"malformed reply from {self.path}: {exc}") from exc
