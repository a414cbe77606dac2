"""attach(): map another process's pool by fd, after checking it is safe to.

Peers elsewhere map whatever size the other side declares and never check seals, so a
misbehaving server can SIGBUS them. Here every fd is checked before mapping: its size
must cover the manifest, and a memfd must carry SHRINK|GROW seals (unsealed /dev/shm
fallback pools only with `allow_unsealed=True`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import struct
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from hostpool.errors import ShareError
from hostpool.memory import syscalls
from hostpool.memory.region import tensor_over
from hostpool.share import protocol

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ShareError(f"manifest names an unknown dtype {name!r}")
    return value


@dataclass
class AttachedPool:
    """A peer's view of a pool: tensors over the server's pages, and the connection."""

    pool: str
    manifest: dict[str, Any]
    tensors: list[torch.Tensor]
    received_bytes: int
    _sock: socket.socket | None = field(repr=False, default=None)

    def list_pools(self) -> list[dict[str, Any]]:
        """Ask the server what it shares (raises ConnectionError once it is gone)."""
        if self._sock is None:
            raise ConnectionError("this attachment is closed")
        protocol.send(self._sock, {"op": "list"})
        reply, _, n = protocol.receive(self._sock)
        self.received_bytes += n
        pools: list[dict[str, Any]] = reply.get("pools", [])
        return pools

    def close(self) -> None:
        """Detach and drop this handle's references; the mapping goes with the last view."""
        sock, self._sock = self._sock, None
        self.tensors = []
        if sock is None:
            return
        with contextlib.suppress(OSError, ConnectionError, protocol.ProtocolError):
            protocol.send(sock, {"op": "detach", "pool": self.pool})
            protocol.receive(sock)
        sock.close()

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(
    path: str,
    pool: str,
    *,
    readonly: bool | None = None,
    allow_unsealed: bool = False,
    prefault: bool = False,
    timeout: float = 30.0,
) -> AttachedPool:
    """Attach to `pool` served at `path`, within `timeout` seconds in all.

    The server decides the access: `readonly=None` takes what it grants this uid (see
    `AttachedPool.manifest["readonly"]` and `["reason"]`), `True` asks for read-only,
    `False` insists on writable (refused unless granted). Raises ShareError when refused,
    unsafe, malformed or past the deadline; ConnectionError when nothing listens there.
    """
    deadline = _Deadline(path, timeout)
    access = "any" if readonly is None else ("read" if readonly else "write")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        deadline.connect(sock)
        try:
            deadline.arm(sock)
            protocol.send(sock, {"op": "attach", "pool": pool, "access": access})
            manifest, _, received = deadline.receive(sock)
        except ConnectionError as exc:
            raise ShareError(
                f"the server at {path} closed the connection: this uid is not allowed, or "
                "the server is at its connection cap (see its hostpool.share_refused event)"
            ) from exc
        if not manifest.get("ok"):
            raise ShareError(f"attach {pool!r} refused: {manifest.get('error')}")
        regions = manifest.get("regions")
        packets = manifest.get("fd_packets")
        granted_readonly = manifest.get("readonly")
        if (
            not isinstance(regions, list)
            or not isinstance(packets, int)
            or not isinstance(granted_readonly, bool)
            or packets != -(-len(regions) // protocol.MAX_FDS_PER_PACKET)
        ):
            raise ShareError("malformed manifest")
        if readonly is False and granted_readonly:
            raise ShareError(f"attach {pool!r}: the server granted read-only access")
        for _ in range(packets):
            deadline.arm(sock)
            message, got, n = deadline.receive(sock, max_fds=protocol.MAX_FDS_PER_PACKET)
            fds.extend(got)
            received += n
            if message.get("op") != "fds":
                raise ShareError("malformed fd packet")
        if len(fds) != len(regions):
            raise ShareError(f"manifest lists {len(regions)} regions but {len(fds)} fds arrived")
        tensors = [
            _map(
                fd,
                region,
                readonly=readonly or granted_readonly,
                allow_unsealed=allow_unsealed,
                prefault=prefault,
            )
            for fd, region in zip(fds, regions, strict=True)
        ]
    except TimeoutError as exc:  # connect or send past the deadline
        sock.close()
        raise deadline.expired() from exc
    except BaseException:
        sock.close()
        raise
    finally:
        protocol.close_all(fds)  # every mapping holds its own reference
    sock.settimeout(timeout)  # later list/detach calls: each within the same bound
    return AttachedPool(pool, manifest, tensors, received, sock)


class _Deadline:
    """One deadline for a whole attach: every socket operation gets only what is left, so
    a server trickling packets cannot hold the caller past `timeout`."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.end = time.monotonic() + timeout

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def arm(self, sock: socket.socket) -> None:
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
        return ShareError(f"attach to {self.path} did not complete within {self.timeout} s")

    def receive(
        self, sock: socket.socket, *, max_fds: int = 0
    ) -> tuple[dict[str, Any], list[int], int]:
        self.arm(sock)
        try:
            return protocol.receive(sock, max_fds=max_fds)
        except TimeoutError as exc:
            raise self.expired() from exc
        except protocol.ProtocolError as exc:
            raise ShareError(f"malformed reply from {self.path}: {exc}") from exc


def _map(
    fd: int, region: dict[str, Any], *, readonly: bool, allow_unsealed: bool, prefault: bool
) -> torch.Tensor:
    nbytes = region.get("bytes")
    dims = region.get("dims")
    if not isinstance(nbytes, int) or nbytes <= 0 or not isinstance(dims, list):
        raise ShareError(f"malformed region in manifest: {region!r}")
    dtype = _dtype(str(region.get("dtype")))
    need = 1
    for d in dims:
        if not isinstance(d, int) or d <= 0:
            raise ShareError(f"malformed dims in manifest: {dims!r}")
        need *= d
    if need * dtype.itemsize > nbytes:
        raise ShareError(f"dims {dims} of {dtype} do not fit the {nbytes} bytes declared")
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise ShareError(
            f"fd is {size} bytes, smaller than the {nbytes} its manifest declares: refusing to "
            "map (a touch past the end would SIGBUS)"
        )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd: a file can always be truncated under us
    if seals & REQUIRED_SEALS != REQUIRED_SEALS and not allow_unsealed:
        raise ShareError(
            f"region {region.get('name')} is not sealed against shrinking: the server could "
            "truncate it and SIGBUS this process; pass allow_unsealed=True to accept that"
        )
    if not readonly and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
        raise ShareError(f"region {region.get('name')}: the server sent a read-only fd")
    if readonly:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        if prefault:
            mm.madvise(syscalls.MADV_POPULATE_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: "buffer is not writable"
            return torch.frombuffer(memoryview(mm), dtype=dtype, count=need).reshape(dims)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    if prefault:
        mm.madvise(syscalls.MADV_POPULATE_READ)
    import ctypes

    holder = (ctypes.c_ubyte * nbytes).from_buffer(mm)
    tensor: torch.Tensor = tensor_over(holder, tuple(dims), dtype)
    return tensor
