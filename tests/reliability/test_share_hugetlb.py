"""Issue 26.9: a writable peer must not be able to SIGBUS the owner of a hugetlb pool.

F_SEAL_SHRINK does not stop `fallocate(PUNCH_HOLE)`: a writable peer punches a hole in
the shared hugetlb memfd, takes the freed hugepages for itself, and the owner's next touch
of that range finds no hugepage to fault in: SIGBUS. Measured on this kernel (6.18), the
one seal that stops punching (and MADV_REMOVE) while the owner keeps its writable
mapping is F_SEAL_FUTURE_WRITE, and it also refuses every new writable mapping: so a
hugetlb region can never be shared writable. The server grants read-only (an O_RDONLY fd
cannot be punched) and refuses `write` with the reason.

The owner runs in its own process, so a SIGBUS is its exit status, not the test runner's.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import subprocess

import pytest

from hostpool.share import protocol
from tests import helpers
from tests.reliability.share_support import NOBODY, Held, public_dir

__all__ = ["public_dir"]
HUGE = 2 << 20
F_SEAL_FUTURE_WRITE = 0x10
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MAP_HUGETLB = 0x40000

# The owner: a 2-page hugetlb pool filled with 3, shared with NOBODY, who is granted
# write. Each line on stdin makes it read every page and print the sum.
OWNER = """
import json, logging, sys
import torch
from hostpool import HostPoolManager
from hostpool.share import PoolShareServer
path, nobody, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
logging.basicConfig(level=logging.INFO, filename=log, format="%(message)s")
m = HostPoolManager()
t = m.allocator("huge", hugepages="required", hugepage_size="2MB").allocate(
    (4 << 20,), torch.uint8
)
t.fill_(3)
server = PoolShareServer(m, path, allowed_uids=[nobody], writable_uids=[nobody]).start()
print("ready", flush=True)
for line in sys.stdin:
    print(int(t.sum()), flush=True)
server.close()
"""


def _fallocate_punch(fd: int, length: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    flags = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if libc.fallocate(fd, flags, ctypes.c_long(0), ctypes.c_long(length)) == 0:
        return "punched"
    return errno.errorcode[ctypes.get_errno()]


def _free_hugepages() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0])
    return info["HugePages_Free"] - info["HugePages_Rsvd"]


def _attack(path: str) -> dict[str, object]:
    """Everything a peer granted write can try: ask for a writable fd and punch it; punch
    and reopen the fd it is given; then take every free hugepage and keep them."""
    out: dict[str, object] = {}
    for access in ("write", "any"):
        s = socket_to(path)
        protocol.send(s, {"op": "attach", "pool": "huge", "access": access})
        head, _, _ = protocol.receive(s)
        if not head.get("ok"):
            out[access] = head.get("error")
            s.close()
            continue
        _, fds, _ = protocol.receive(s, max_fds=protocol.MAX_FDS_PER_PACKET)
        (fd,) = fds
        out[access] = {"readonly": head["readonly"], "reason": head["reason"]}
        out[f"{access}_punch"] = _fallocate_punch(fd, HUGE)
        try:
            again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        except OSError as exc:
            out[f"{access}_reopen"] = errno.errorcode[exc.errno or 0]
        else:
            out[f"{access}_reopen"] = _fallocate_punch(again, HUGE)
            os.close(again)
        KEEP.append((s, fd))
    free = _free_hugepages()
    if free > 0:
        grab = mmap.mmap(-1, free * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
        grab.madvise(mmap.MADV_POPULATE_WRITE if hasattr(mmap, "MADV_POPULATE_WRITE") else 23)
        KEEP.append(grab)
    out["grabbed_hugepages"] = free
    return out


KEEP: list[object] = []


def socket_to(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.settimeout(30)
    s.connect(path)
    return s


@pytest.mark.hugepages
def test_a_writable_peer_cannot_sigbus_a_hugetlb_owner(public_dir: str, hugepages_2m: int) -> None:
    path = os.path.join(public_dir, "s", "pool.sock")
    log = os.path.join(public_dir, "events.log")
    owner = helpers.python_child(OWNER, path, str(NOBODY), log)
    try:
        attacker = Held(lambda: _attack(path), uid=NOBODY)
        try:
            touched = _touch(owner)
        finally:
            attacker.end()
        result = attacker.result
        assert touched == 3 * (4 << 20), f"the owner died touching its own pool: {result}"
        # write is refused with the reason; what is granted is read-only and unpunchable
        assert "hugetlb" in str(result["write"]) and "punch" in str(result["write"]), result
        assert result["any"]["readonly"] is True, result
        assert "hugetlb" in result["any"]["reason"], result
        assert result["any_punch"] == "EBADF", result
        assert result["any_reopen"] == "EACCES", result
        assert result["grabbed_hugepages"] >= 1, result  # the pool was taken dry
    finally:
        assert owner.stdin is not None and owner.stdout is not None
        owner.stdin.close()
        code = owner.wait(timeout=60)
        owner.stdout.close()
    assert code == 0, f"owner exit status {code}"


def _touch(owner: subprocess.Popen[str]) -> int | None:
    """Make the owner read every page of its pool: the sum, or None if it died."""
    assert owner.stdin is not None and owner.stdout is not None
    try:
        owner.stdin.write("touch\n")
        owner.stdin.flush()
    except BrokenPipeError:
        return None
    line = owner.stdout.readline()
    return int(line) if line.strip() else None
