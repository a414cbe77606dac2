"""`lease()`: borrow a pool of the broker (`hostpool serve --share-socket PATH`).

A lease is the pool's memory mapped writable and contiguous in this process (its regions
side by side at one address, whatever chunks the broker allocated it in), and, asked for,
the pool's metadata memfd mapped beside it. It lives as long as the connection: `close()`
(or the process's death) ends it, and the broker keeps the memory and its contents.

Torch-free: `Lease.buffer()` is a ctypes array over the mapping (for `torch.frombuffer`
or numpy), `Lease.index` an mmap of the metadata memfd.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import socket
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any

from hostpool.errors import InvalidRequestError, ShareError
from hostpool.share import protocol
from hostpool.share.deadline import AttachDeadline

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_PEERCRED = struct.Struct("3i")
_MAP_FIXED = 0x10
_PROT_NONE = 0  # not in Python 3.11's mmap
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int


def _mmap(address: int | None, length: int, prot: int, flags: int, fd: int) -> int:
    got = _libc.mmap(address, length, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(got)


def map_side_by_side(fds: list[int], sizes: list[int]) -> int:
    """Map each fd's first `sizes[i]` bytes (whole pages) writable and shared, one after
    the other at one address (reserved first, so nothing else lands between them)."""
    total = sum(sizes)
    base = _mmap(None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
    try:
        at = base
        for fd, size in zip(fds, sizes, strict=True):
            rw = mmap.PROT_READ | mmap.PROT_WRITE
            _mmap(at, size, rw, mmap.MAP_SHARED | _MAP_FIXED, fd)
            at += size
    except BaseException:
        _libc.munmap(base, total)
        raise
    return base


class MappingHolder:
    """Owns a mapping of `size` bytes at `address`: unmapped when this object is
    collected. Arrays made by `array()` keep it alive."""

    def __init__(self, address: int, size: int) -> None:
        self.address, self.size = address, size
        weakref.finalize(self, _libc.munmap, address, size)

    def array(self, offset: int, nbytes: int) -> ctypes.Array[ctypes.c_ubyte]:
        """A ctypes array over [offset, offset + nbytes) that keeps this holder alive."""
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.size:
            raise ShareError(f"[{offset}, {offset + nbytes}) is outside a {self.size}-byte mapping")
        view = (ctypes.c_ubyte * nbytes).from_address(self.address + offset)
        view.holder = self  # type: ignore[attr-defined]  # ctypes instances take attributes
        return view


@dataclass
class Lease:
    """A pool leased from the broker: `size` bytes at `address` (regions of `sizes` bytes,
    their fds `fds`), the metadata memfd `index_fd` mapped as `index` (None unless asked
    for), and the connection the lease lives on. A context manager."""

    pool: str
    address: int
    size: int
    fds: list[int]
    sizes: list[int]
    index_fd: int | None
    index: mmap.mmap | None
    manifest: dict[str, Any]
    _sock: socket.socket | None = field(repr=False, default=None)

    def buffer(self) -> ctypes.Array[ctypes.c_ubyte]:
        """A ctypes array over the whole mapping. It does not keep the mapping alive:
        drop every view of it before `close()`."""
        if not self.address:
            raise ShareError(f"the lease of {self.pool!r} is closed")
        return (ctypes.c_ubyte * self.size).from_address(self.address)

    def hand_over(self) -> MappingHolder:
        """Hand the mapping to a holder: from now on it is unmapped when the holder is
        collected (views over it keep the holder: `holder.array(offset, nbytes)`), not by
        `close()`, which then only ends the lease. For memory handed to code that may
        keep views past the lease (an engine's tensors)."""
        if not self.address:
            raise ShareError(f"the lease of {self.pool!r} has no mapping to hand over")
        holder = MappingHolder(self.address, self.size)
        self.address = 0
        return holder

    def report(
        self,
        adopted: int,
        discarded: dict[str, int],
        *,
        reason: str | None = None,
        field_: str | None = None,
    ) -> None:
        """Tell the broker what was adopted from the index (its metrics and events)."""
        message = {
            "op": "lease_report",
            "pool": self.pool,
            "adopted": adopted,
            "discarded": discarded,
            "reason": reason,
            "field": field_,
        }
        reply = self._ask(message)
        if not reply.get("ok"):
            raise ShareError(f"lease report of {self.pool!r} refused: {reply.get('error')}")

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._sock is None:
            raise ShareError(f"the lease of {self.pool!r} is closed")
        try:
            protocol.send(self._sock, message)
            reply, fds, _ = protocol.receive(self._sock)
        except (OSError, protocol.ProtocolError) as exc:
            raise ShareError(f"the broker of {self.pool!r} is gone or misbehaved: {exc}") from exc
        protocol.close_all(fds)
        return reply

    def close(self) -> None:
        """Unmap, close the fds and the connection: the lease ends, the broker keeps the
        memory. Idempotent."""
        sock, self._sock = self._sock, None
        if self.index is not None:
            self.index.close()
            self.index = None
        if self.address:
            _libc.munmap(self.address, self.size)
            self.address = 0
        protocol.close_all([*self.fds, *([self.index_fd] if self.index_fd is not None else [])])
        self.fds, self.index_fd = [], None
        if sock is not None:
            sock.close()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lease(
    path: str,
    pool: str,
    *,
    timeout: float = 30.0,
    memory: bool = True,
    index_bytes: int | None = None,
) -> Lease:
    """Lease `pool` of the broker at `path` within `timeout` seconds: its memory (unless
    `memory=False`) and, with `index_bytes`, its metadata memfd of that size.

    The broker must run as this uid or root (SO_PEERCRED). ShareError names the holder's
    pid when another process leases the pool, and says why for everything else (no
    broker, no such pool, a region not sealed against resizing, past the deadline)."""
    if not memory and index_bytes is None:
        raise InvalidRequestError("lease what? memory=False and no index_bytes")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout!r}")
    deadline = AttachDeadline(path, timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    index_fd: int | None = None
    address = 0
    sizes: list[int] = []
    try:
        deadline.connect(sock)
        pid, uid, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid not in (os.geteuid(), 0):
            raise ShareError(f"the broker at {path} runs as uid {uid} (pid {pid}), not this one")
        head: dict[str, Any] = {}
        if memory:
            head, fds = _ask(sock, deadline, {"op": "lease", "pool": pool, "part": "memory"})
            regions = head.get("regions")
            if not isinstance(regions, list) or len(regions) != len(fds):
                what = f"{len(fds)} fds for {regions!r}"[:200]
                raise ShareError(f"malformed lease of {pool!r}: {what}")
            sizes = [_checked(fd, r) for fd, r in zip(fds, regions, strict=True)]
            address = map_side_by_side(fds, sizes)
        index = None
        if index_bytes is not None:
            message = {"op": "lease", "pool": pool, "part": "index", "index_bytes": index_bytes}
            _, (index_fd,) = _ask(sock, deadline, message)
            _checked(index_fd, {"bytes": index_bytes, "name": f"{pool} index"})
            index = mmap.mmap(index_fd, index_bytes, flags=mmap.MAP_SHARED)
    except BaseException:
        if address:
            _libc.munmap(address, sum(sizes))
        protocol.close_all([*fds, *([index_fd] if index_fd is not None else [])])
        sock.close()
        raise
    sock.settimeout(timeout)
    return Lease(pool, address, sum(sizes), fds, sizes, index_fd, index, head, sock)


def _ask(
    sock: socket.socket, deadline: AttachDeadline, message: dict[str, Any]
) -> tuple[dict[str, Any], list[int]]:
    """Send a lease request; (the reply's head, the fds that followed)."""
    try:
        deadline.arm(sock)
        protocol.send(sock, message)
        head, _, _ = deadline.receive(sock)
    except ConnectionError as exc:
        raise ShareError(
            f"the broker at {deadline.path} closed the connection: this uid is not allowed "
            "to connect, or it is at its connection cap (see its hostpool.share_refused event)"
        ) from exc
    if not head.get("ok"):
        raise ShareError(f"lease of {message['pool']!r} refused: {head.get('error')}")
    packets = head.get("fd_packets", 1)
    fds: list[int] = []
    try:
        for _ in range(packets if isinstance(packets, int) else 0):
            got, more, _ = deadline.receive(sock, max_fds=protocol.MAX_FDS_PER_PACKET)
            fds.extend(more)
            if got.get("op") != "fds":
                raise ShareError("malformed fd packet")
    except BaseException:
        protocol.close_all(fds)
        raise
    return head, fds


def _checked(fd: int, region: dict[str, Any]) -> int:
    """The region's size, once its fd is seen to cover it, sealed against resizing and
    open for writing."""
    nbytes = region.get("bytes")
    name = region.get("name")
    if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % mmap.PAGESIZE:
        raise ShareError(f"malformed region size {nbytes!r} of {name}")
    if os.fstat(fd).st_size < nbytes:
        raise ShareError(f"region {name} is smaller than the {nbytes} bytes declared")
    with contextlib.suppress(OSError):
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & REQUIRED_SEALS == REQUIRED_SEALS:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
                raise ShareError(f"region {name}: the broker sent a read-only fd")
            return nbytes
    raise ShareError(f"region {name} is not sealed against resizing: not leased")
