"""Hugetlb memfds are sealed against hole punching once their owner has mapped them.

F_SEAL_SHRINK does not stop `fallocate(PUNCH_HOLE)`, and a hole punched in a hugetlb memfd
is a SIGBUS for whoever touches it next. So `share.attach` accepts a hugetlb fd from a
server of another uid only if it is sealed against punching. hostpool seals its hugetlb
memfds with F_SEAL_FUTURE_WRITE right after mapping them: punching and MADV_REMOVE are
refused to everyone, the owner's mapping stays writable, and no new writable mapping can
be made (hostpool never makes one: hugetlb pools are shared read-only).

Real hugepages (root; the fixture restores nr_hugepages); the owner and the peer are forked
children running as two unprivileged uids, so neither is trusted as root.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import select
import time
from typing import Any

import pytest
import torch

from hostpool import HostPoolManager
from hostpool.errors import ShareError
from hostpool.memory import shm
from hostpool.share import PoolShareServer, attach
from tests.reliability.share_support import Held, public_dir
from tests.waiting import DEADLINE

__all__ = ["public_dir"]
HUGE = 2 << 20
SIZE = 4 << 20
POOL = "sealedhuge"
OWNER_UID, PEER_UID = 65534, 65533
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MADV_REMOVE = 9
# F_SEAL_EXEC (0x20) joins them where the kernel has MFD_NOEXEC_SEAL.
EXPECTED = shm.SEALS | shm.F_SEAL_FUTURE_WRITE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _outcome(rc: int) -> str:
    return "ok" if rc == 0 else errno.errorcode[ctypes.get_errno()]


def _punch(fd: int) -> str:
    return _outcome(_libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, HUGE))


def _map_writable(fd: int) -> str:
    try:
        mmap.mmap(fd, HUGE, flags=mmap.MAP_SHARED).close()
    except OSError as exc:
        return errno.errorcode[exc.errno or 0]
    return "mapped"


@pytest.mark.hugepages
def test_the_owner_keeps_writing_and_nobody_punches(hugepages_2m: int) -> None:
    with HostPoolManager() as manager:
        allocator = manager.allocator(POOL, hugepages="required", hugepage_size="2MB")
        tensor = allocator.allocate((SIZE,), torch.uint8)
        (region,) = allocator.regions
        assert region.facts.page_size == HUGE and region.fd is not None
        assert region.facts.seals == fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
        assert region.facts.seals & EXPECTED == EXPECTED
        # Populated after the seal, through the owner's own mapping.
        assert region.facts.populate_mode == "madvise" and region.resident_bytes() == SIZE
        tensor.fill_(7)
        assert int(tensor.sum()) == 7 * SIZE
        assert _punch(region.fd) == "EPERM"
        assert _outcome(_libc.madvise(region.facts.address, HUGE, MADV_REMOVE)) == "EPERM"
        assert _map_writable(region.fd) == "EPERM"  # the contract: no second writable map
        tensor.fill_(8)  # still writable, every page (none was punched)
        assert int(tensor.sum()) == 8 * SIZE
        del tensor


def _read_line(fd: int) -> dict[str, Any]:
    """One JSON line from a child's pipe, within DEADLINE (the pipe is the event)."""
    data = b""
    deadline = time.monotonic() + DEADLINE
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        assert chunk, f"the child said nothing more (got {data!r})"
        data += chunk
    line: dict[str, Any] = json.loads(data)
    return line


class Owner:
    """The pool's owner, forked and running as OWNER_UID: a 4 MiB hugetlb pool of 5s shared
    with PEER_UID (granted write). It reports its seals and what punching its own pool
    does, then answers `write` (fill with 9, report the sum) until `end`."""

    def __init__(self, path: str) -> None:
        cmd_r, self._cmd = os.pipe()
        self._out, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(self._cmd)
                os.close(self._out)
                torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
                os.setgroups([])
                os.setgid(OWNER_UID)
                os.setuid(OWNER_UID)
                code = _own(path, cmd_r, out_w)
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.write(out_w, json.dumps({"error": repr(exc)}).encode() + b"\n")
            finally:
                os._exit(code)
        os.close(cmd_r)
        os.close(out_w)
        self.pid = pid
        self.ready = _read_line(self._out)

    def ask(self, command: str) -> dict[str, Any]:
        os.write(self._cmd, command.encode() + b"\n")
        return _read_line(self._out)

    def end(self) -> int:
        with contextlib.suppress(OSError):
            os.write(self._cmd, b"end\n")
        os.close(self._cmd)
        os.close(self._out)
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


def _own(path: str, cmd_r: int, out_w: int) -> int:
    manager = HostPoolManager()
    allocator = manager.allocator(POOL, hugepages="required", hugepage_size="2MB")
    tensor = allocator.allocate((SIZE,), torch.uint8)
    tensor.fill_(5)
    (region,) = allocator.regions
    assert region.fd is not None
    # The peer is even granted write: a hugetlb pool is still shared read-only.
    server = PoolShareServer(
        manager, path, allowed_uids=[PEER_UID], writable_uids=[PEER_UID]
    ).start()
    report = {
        "seals": region.facts.seals,
        "kernel_seals": fcntl.fcntl(region.fd, fcntl.F_GET_SEALS),
        "punch": _punch(region.fd),
        "madv_remove": _outcome(_libc.madvise(region.facts.address, HUGE, MADV_REMOVE)),
        "sum": int(tensor.sum()),
    }
    os.write(out_w, json.dumps(report).encode() + b"\n")
    with os.fdopen(cmd_r) as commands:
        for line in commands:
            if line.strip() != "write":
                break
            tensor.fill_(9)
            os.write(out_w, json.dumps({"sum": int(tensor.sum())}).encode() + b"\n")
    server.close()
    allocator.release(tensor)
    del tensor
    return 0 if not manager.close() else 2


KEEP: list[object] = []


def _peer(path: str) -> dict[str, object]:
    """As PEER_UID: ask for write, then attach as granted; try to punch, reopen and map
    writable what it was given."""
    out: dict[str, object] = {}
    try:
        attach(path, POOL, readonly=False, server_uids=[OWNER_UID])
        out["write"] = "granted"
    except ShareError as exc:
        out["write"] = str(exc)
    pool = attach(path, POOL, server_uids=[OWNER_UID])
    KEEP.append(pool)
    out["readonly"] = pool.manifest["readonly"]
    out["sum"] = int(pool.tensors[0].sum())
    # The fd behind the peer's mapping (mmap's dup of the O_RDONLY fd it received).
    (fd,) = [
        int(n)
        for n in os.listdir("/proc/self/fd")
        if f"hostpool.{POOL}." in _link(f"/proc/self/fd/{n}")
    ]
    out["seals"] = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    out["punch"] = _punch(fd)
    try:
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
        out["reopen"] = "reopened"
    except OSError as exc:
        out["reopen"] = errno.errorcode[exc.errno or 0]
    out["map_writable"] = _map_writable(fd)
    return out


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


@pytest.mark.hugepages
def test_a_peer_of_another_uid_attaches_read_only_and_cannot_punch(
    public_dir: str, hugepages_2m: int
) -> None:
    home = os.path.join(public_dir, "owner")
    os.mkdir(home, 0o755)
    os.chown(home, OWNER_UID, OWNER_UID)
    path = os.path.join(home, "s", "pool.sock")
    owner = Owner(path)
    try:
        ready = owner.ready
        assert "error" not in ready, ready
        assert ready["seals"] == ready["kernel_seals"], ready
        assert ready["seals"] & EXPECTED == EXPECTED, ready
        assert ready["punch"] == ready["madv_remove"] == "EPERM", ready  # not even the owner
        assert ready["sum"] == 5 * SIZE, ready
        peer = Held(lambda: _peer(path), uid=PEER_UID)
        try:
            seen = peer.result
        finally:
            peer.end()
        assert "hugetlb" in str(seen["write"]), seen  # never shared writable
        assert seen["readonly"] is True and seen["sum"] == 5 * SIZE, seen
        assert seen["seals"] == ready["seals"], seen
        assert seen["punch"] == "EBADF", seen  # an O_RDONLY fd; the seal stops the rest
        assert seen["reopen"] == "EACCES" and seen["map_writable"] == "EACCES", seen
        # The owner's mapping is still writable after the seal and the peer's visit.
        assert owner.ask("write") == {"sum": 9 * SIZE}
    finally:
        code = owner.end()
    assert code == 0, f"owner exit status {code}"
