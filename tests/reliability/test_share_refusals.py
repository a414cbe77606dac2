"""Issue 26.8: a refused or failed attach leaves nothing open in the server. The server
borrows a dup of every region's fd to build a reply; a refusal (uid not granted write, an
unsealed region asked writable, no such pool) or a peer hanging up before its reply is
read must close every one of them, or any allowed peer can exhaust the LLM server's fds.

The server runs in this process, so /proc/self/fd is the server's fd table."""

from __future__ import annotations

import os
import socket

import torch

from hostpool import HostPoolManager
from hostpool.errors import ShareError
from hostpool.share import PoolShareServer, attach, protocol
from tests import helpers
from tests.reliability.share_support import NOBODY, process_fds, public_dir
from tests.waiting import wait_for

__all__ = ["public_dir"]
ROUNDS = 50  # per kind of refusal: 4 kinds, 200 refused or failed attaches in all


def _sockets() -> int:
    return sum(1 for target in process_fds().values() if target.startswith("socket:"))


def _refused_as_other_uid(path: str) -> str:
    """As an allowed uid without a write grant: ask for write, `ROUNDS` times."""
    reasons = set()
    for _ in range(ROUNDS):
        try:
            attach(path, "three", readonly=False, timeout=30)
        except ShareError as exc:
            reasons.add(str(exc))
        else:
            return "granted"
    return " | ".join(sorted(reasons))


def _hang_up_mid_reply(path: str, pool: str) -> None:
    """Ask, read the manifest, and hang up before the fd packets are read."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(30)
        s.connect(path)
        protocol.send(s, {"op": "attach", "pool": pool, "access": "read"})
        head, fds, _ = protocol.receive(s)
        protocol.close_all(fds)
        assert head["ok"] and head["fd_packets"] == 1, head


def _hang_up_before_reply(path: str, pool: str) -> None:
    """Ask and hang up at once: the server replies to a peer that is gone."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.connect(path)
        protocol.send(s, {"op": "attach", "pool": pool, "access": "read"})


def test_200_refused_and_failed_attaches_leave_no_server_fd(public_dir: str) -> None:
    path = os.path.join(public_dir, "s", "pool.sock")
    before_server = process_fds()
    with HostPoolManager() as manager:
        tensors = [manager.allocator("three").allocate((1 << 20,), torch.uint8) for _ in range(3)]
        tensors.append(
            manager.allocator("fallback", shm_backend="devshm").allocate((1 << 20,), torch.uint8)
        )
        server = PoolShareServer(manager, path, allowed_uids=[NOBODY]).start()
        try:
            baseline = process_fds()
            # 1. another uid (a real setuid child), allowed read-only, asks for write
            code, out = helpers.run_forked(lambda: _refused_as_other_uid(path), uid=NOBODY)
            assert code == 0 and "not granted write access" in out, out
            # 2. this uid asks for write on a region that cannot be sealed
            # 3. a pool that does not exist
            for _ in range(ROUNDS):
                for pool, access, why in (
                    ("fallback", False, "not sealed against shrinking"),
                    ("no-such-pool", None, "no shareable pool"),
                ):
                    try:
                        attach(path, pool, readonly=access, allow_unsealed=True, timeout=30)
                    except ShareError as exc:
                        assert why in str(exc), exc
                    else:
                        raise AssertionError(f"{pool} attached")
            # 4. peers hanging up mid-reply and before the reply
            for _ in range(ROUNDS // 2):
                _hang_up_mid_reply(path, "three")
                _hang_up_before_reply(path, "three")
            # The loop serves connections in its own time: the event is every peer's
            # socket gone from the server's fd table.
            wait_for(
                lambda: _sockets() <= sum(t.startswith("socket:") for t in baseline.values()),
                "the server closed every peer connection",
            )
            leaked = {fd: t for fd, t in process_fds().items() if baseline.get(fd) != t}
            assert leaked == {}, f"{len(leaked)} fds left open in the server: {leaked}"
            # ... and it still serves.
            with attach(path, "three", timeout=30) as h:
                assert len(h.tensors) == 3
        finally:
            server.close()
        del tensors
    assert process_fds() == before_server
