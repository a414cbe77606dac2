"""attach(): map another process's pool by fd, after checking it is safe to.

Peers elsewhere map whatever size the other side declares and never check seals, so a
misbehaving or squatting server can SIGBUS or OOM-kill them. Here the server's uid is
checked first (SO_PEERCRED), and every fd before anything is mapped: its size must cover
the manifest, the total must fit `max_bytes` (or the budget), a memfd must carry
SHRINK|GROW seals (unsealed /dev/shm fallback pools only with `allow_unsealed=True`), and
an fd from a server of another uid (not this one, not root) must be sealed against hole
punching: such a server could otherwise punch holes after the attach, and this process
would fault fresh pages charged to its own cgroup (or SIGBUS, for hugetlb pages).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import socket
import struct
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

from hostpool._lazy import require_torch
from hostpool.base.units import format_size
from hostpool.core.budget import Admission
from hostpool.errors import AllocationError, InvalidRequestError, ShareError
from hostpool.memory import syscalls
from hostpool.memory.holders import tensor_over
from hostpool.share import access, protocol
from hostpool.share.deadline import AttachDeadline

if TYPE_CHECKING:  # imported when attach() is called (TorchUnavailableError without)
    import torch

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_PEERCRED = struct.Struct("3i")


def _dtype(name: str) -> torch.dtype:
    import torch  # attach() checked it is there

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
        """Ask the server what it shares; ShareError once it is gone, or closed here."""
        if self._sock is None:
            raise ShareError(f"this attachment to {self.pool!r} is closed")
        try:
            protocol.send(self._sock, {"op": "list"})
            reply, fds, n = protocol.receive(self._sock)
        except (OSError, protocol.ProtocolError) as exc:  # ConnectionError is an OSError
            raise ShareError(f"the server of {self.pool!r} is gone or misbehaved: {exc}") from exc
        protocol.close_all(fds)
        self.received_bytes += n
        pools = reply.get("pools")
        if not isinstance(pools, list):
            raise ShareError(f"malformed list reply: {reply!r}"[:200])
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
    max_bytes: int | None = None,
    server_uids: Iterable[int] | None = None,
) -> AttachedPool:
    """Attach to `pool` served at `path`, within `timeout` seconds in all.

    The server decides the access: `readonly=None` takes what it grants this uid (see
    `AttachedPool.manifest["readonly"]` and `["reason"]`), `True` asks for read-only,
    `False` insists on writable (refused unless granted).

    Whoever binds the path first is a server, so nothing it sends is believed unchecked,
    and every check runs before anything is mapped:

    - the server must run as one of `server_uids` (SO_PEERCRED; default: this process's
      uid and root), checked before the request is sent;
    - `max_bytes` caps the bytes mapped in all; by default (None) the bytes mapping and
      touching could make the kernel allocate (the regions' pages not resident at
      attach, hugetlb ones aside: their mmap reserves or fails) must fit what hostpool's
      budget admits now: MemAvailable minus headroom, and the cgroup's room;
    - each fd covers its manifest size and is sealed against shrinking and growing
      (unsealed /dev/shm files only with `allow_unsealed=True`); a writable mapping needs
      a writable fd not sealed against writing;
    - an fd from a server running as another uid than this one or root (those could kill
      this process anyway) must be sealed against hole punching (F_SEAL_WRITE or
      F_SEAL_FUTURE_WRITE), so such a server's shares are read-only. Otherwise, after the
      attach, its owner could punch holes: this process's next touch of a punched page
      allocates a fresh one charged to this process's cgroup (an OOM kill the attach-time
      budget check cannot foresee), or, for hugetlb pages, SIGBUSes. `allow_unsealed=True`
      accepts that risk for memfds (a hugetlb fd from such a server is refused anyway).

    Raises InvalidRequestError for bad arguments, and ShareError (hostpool.errors) for
    everything else: nothing listening at `path`, refused, untrusted, too large, unsafe,
    malformed, or past the deadline. A refusal leaves no fd and no mapping behind.
    TorchUnavailableError (before anything is asked) where torch cannot be imported.
    """
    require_torch("hostpool.share.attach (tensors over a served pool)")
    limit = _max_bytes(max_bytes)
    trusted = _server_uids(server_uids)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout!r}")
    deadline = AttachDeadline(path, timeout)
    access = "any" if readonly is None else ("read" if readonly else "write")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        deadline.connect(sock)
        server_uid = _check_server(sock, path, trusted)
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
            or not regions
            or not all(isinstance(r, dict) for r in regions)
            or not isinstance(packets, int)
            or not isinstance(granted_readonly, bool)
            or packets != -(-len(regions) // protocol.MAX_FDS_PER_PACKET)
        ):
            raise ShareError("malformed manifest")
        if readonly is False and granted_readonly:
            raise ShareError(f"attach {pool!r}: the server granted read-only access")
        for _ in range(packets):
            deadline.arm(sock)
            try:
                message, got, n = deadline.receive(sock, max_fds=protocol.MAX_FDS_PER_PACKET)
            except ConnectionError as exc:
                raise ShareError(f"the server at {path} hung up during attach") from exc
            fds.extend(got)
            received += n
            if message.get("op") != "fds":
                raise ShareError("malformed fd packet")
        if len(fds) != len(regions):
            raise ShareError(f"manifest lists {len(regions)} regions but {len(fds)} fds arrived")
        plans = [
            _Plan.check(
                fd,
                region,
                writable=not (readonly or granted_readonly),
                allow_unsealed=allow_unsealed,
                server_uid=server_uid,
            )
            for fd, region in zip(fds, regions, strict=True)
        ]
        _check_size(pool, plans, limit)
        tensors = [plan.map(prefault=prefault) for plan in plans]
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


def _max_bytes(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequestError(f"max_bytes must be a positive number of bytes, got {value!r}")
    return value


def _server_uids(value: Iterable[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset({os.geteuid(), 0})
    uids = list(value)
    for uid in uids:
        if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
            raise InvalidRequestError(f"server_uids must be uids (ints >= 0), got {uid!r}")
    return frozenset(uids)


def _check_server(sock: socket.socket, path: str, trusted: frozenset[int]) -> int:
    """The server's uid (SO_PEERCRED), if it is one of `trusted`; else ShareError."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, _ = _PEERCRED.unpack(raw)
    if uid not in trusted:
        raise ShareError(
            f"the server at {path} runs as uid {uid} (pid {pid}), not one of server_uids "
            f"{sorted(trusted)}: whoever binds a path first answers there; pass "
            f"server_uids=[{uid}] if that server is yours"
        )
    return int(uid)


def _check_size(pool: str, plans: list[_Plan], limit: int | None) -> None:
    """Refuse, before mapping, more than `limit` bytes, or by default more bytes the
    kernel would have to allocate than hostpool's budget admits."""
    total = sum(p.nbytes for p in plans)
    if limit is not None:
        if total > limit:
            raise ShareError(
                f"attach {pool!r}: the server offers {total} bytes ({format_size(total)}) in "
                f"{len(plans)} regions, more than max_bytes {limit} ({format_size(limit)})"
            )
        return
    holes = sum(p.holes for p in plans)
    if holes == 0:
        return
    try:
        with Admission(None, lambda: 0, kernel_reason="no_memory").reserve(holes, None):
            pass
    except AllocationError as exc:
        raise ShareError(
            f"attach {pool!r}: {holes} of the {total} bytes offered are not resident, and "
            f"touching them would allocate them in this process: {exc}; pass max_bytes to "
            "accept a larger pool"
        ) from None


@dataclass(frozen=True)
class _Plan:
    """One region, checked and ready to map."""

    fd: int
    name: str
    nbytes: int
    dims: tuple[int, ...]
    count: int
    dtype: torch.dtype
    writable: bool
    holes: int  # bytes not resident now (0 for hugetlb: their mmap reserves or fails)

    @classmethod
    def check(
        cls,
        fd: int,
        region: dict[str, Any],
        *,
        writable: bool,
        allow_unsealed: bool,
        server_uid: int,
    ) -> _Plan:
        nbytes = region.get("bytes")
        dims = region.get("dims")
        name = str(region.get("name"))
        if not _is_count(nbytes) or not isinstance(dims, list) or not dims:
            raise ShareError(f"malformed region in manifest: {_short(region)}")
        dtype_name = region.get("dtype")
        if not isinstance(dtype_name, str):
            raise ShareError(f"malformed dtype in manifest: {dtype_name!r}")
        dtype = _dtype(dtype_name)
        count = 1
        for d in dims:
            if not _is_count(d):
                raise ShareError(f"malformed dims in manifest: {_short(dims)}")
            count *= d
        if count * dtype.itemsize > nbytes:
            raise ShareError(f"dims {dims} of {dtype} do not fit the {nbytes} bytes declared")
        st = os.fstat(fd)
        if st.st_size < nbytes:
            raise ShareError(
                f"fd is {st.st_size} bytes, smaller than the {nbytes} its manifest declares: "
                "refusing to map (a touch past the end would SIGBUS)"
            )
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a memfd: a file can always be truncated under us
        if seals & REQUIRED_SEALS != REQUIRED_SEALS and not allow_unsealed:
            raise ShareError(
                f"region {name} is not sealed against shrinking (seals {seals:#x}): the "
                "server could truncate it and SIGBUS this process; pass allow_unsealed=True "
                "to accept that"
            )
        huge = access.is_hugetlb(fd)
        punchable = not seals & access.PUNCH_SEALS and server_uid not in (os.geteuid(), 0)
        if punchable and huge:
            raise ShareError(
                f"region {name} is a hugetlb memfd from a server running as uid {server_uid}, "
                f"not sealed against hole punching (seals {seals:#x}): its owner could punch "
                "a hole and take the hugepages, and this process would SIGBUS; hugetlb fds "
                "are accepted from servers of this uid or root, or sealed with "
                "F_SEAL_FUTURE_WRITE"
            )
        if punchable and not allow_unsealed:
            raise ShareError(
                f"region {name} comes from a server running as uid {server_uid} and is not "
                f"sealed against hole punching (seals {seals:#x}): after the attach its owner "
                "could punch holes, and every page this process then touched would be "
                "allocated anew and charged to this process's cgroup; memfds of another "
                "uid's server are accepted sealed with F_SEAL_FUTURE_WRITE (read-only), or "
                "with allow_unsealed=True"
            )
        if writable:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
                raise ShareError(f"region {name}: the server sent a read-only fd")
            if seals & access.PUNCH_SEALS:
                raise ShareError(
                    f"region {name} is sealed against writing (seals {seals:#x}): the kernel "
                    "refuses a writable mapping; attach with readonly=True"
                )
        holes = 0 if huge else max(0, nbytes - st.st_blocks * 512)
        return cls(fd, name, nbytes, tuple(dims), count, dtype, writable, holes)

    def map(self, *, prefault: bool) -> torch.Tensor:
        """Map the region (ShareError when the kernel refuses: a hugetlb reservation)."""
        try:
            if not self.writable:
                mm = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            else:
                mm = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        except OSError as exc:
            raise ShareError(
                f"cannot map region {self.name} ({self.nbytes} bytes): {exc.strerror}"
            ) from None
        try:
            if prefault:
                mm.madvise(syscalls.MADV_POPULATE_READ)
        except OSError as exc:
            mm.close()
            raise ShareError(
                f"cannot prefault region {self.name} ({self.nbytes} bytes): {exc.strerror}"
            ) from None
        import torch  # attach() checked it is there

        if not self.writable:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch: "buffer is not writable"
                view = torch.frombuffer(memoryview(mm), dtype=self.dtype, count=self.count)
            return view.reshape(self.dims)
        holder = (ctypes.c_ubyte * self.nbytes).from_buffer(mm)
        tensor: torch.Tensor = tensor_over(holder, self.dims, self.dtype)
        return tensor


def _is_count(value: object) -> TypeGuard[int]:
    """A positive integer (JSON `true` is a Python bool, which is an int: not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
