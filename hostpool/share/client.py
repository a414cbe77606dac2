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
    readonly: bool = False,
    allow_unsealed: bool = False,
    prefault: bool = False,
    timeout: float = 30.0,
) -> AttachedPool:
    """Attach to `pool` served at `path`. Raises ShareError when refused or unsafe,
    ConnectionError when the server is unreachable."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    fds: list[int] = []
    try:
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
            # Name the path: "[Errno 2] No such file or directory" alone says nothing.
            raise ShareError(
                f"cannot attach to {path}: {exc.strerror} (is `hostpool serve "
                "--share-socket` running with this path?)"
            ) from exc
        try:
            protocol.send(sock, {"op": "attach", "pool": pool, "readonly": readonly})
            manifest, _, received = protocol.receive(sock)
        except ConnectionError as exc:
            raise ShareError(
                f"the server at {path} closed the connection: this uid is not allowed "
                "(see the server's hostpool.share_refused event)"
            ) from exc
        if not manifest.get("ok"):
            raise ShareError(f"attach {pool!r} refused: {manifest.get('error')}")
        regions = manifest.get("regions")
        packets = manifest.get("fd_packets")
        if not isinstance(regions, list) or not isinstance(packets, int) or packets < 1:
            raise ShareError("malformed manifest")
        for _ in range(packets):
            message, got, n = protocol.receive(sock, max_fds=protocol.MAX_FDS_PER_PACKET)
            fds.extend(got)
            received += n
            if message.get("op") != "fds":
                raise ShareError("malformed fd packet")
        if len(fds) != len(regions):
            raise ShareError(f"manifest lists {len(regions)} regions but {len(fds)} fds arrived")
        tensors = [
            _map(fd, region, readonly=readonly, allow_unsealed=allow_unsealed, prefault=prefault)
            for fd, region in zip(fds, regions, strict=True)
        ]
    except BaseException:
        sock.close()
        raise
    finally:
        protocol.close_all(fds)  # every mapping holds its own reference
    return AttachedPool(pool, manifest, tensors, received, sock)


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
