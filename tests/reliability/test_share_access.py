"""Issue 17.1: a peer must not be able to SIGBUS the owner. The server decides each uid's
access; writable only for memfds sealed against shrinking; a read-only peer can neither
truncate its fd nor reopen it writable through /proc/self/fd."""

from __future__ import annotations

import errno
import json
import os

from hostpool.errors import ShareError
from hostpool.share import attach
from tests import helpers
from tests.reliability.share_support import FULL_SUM, NOBODY, Server, fds_of, public_dir

__all__ = ["public_dir"]
MiB = 1 << 20


def _try_to_shrink(pool: str) -> dict[str, object]:
    """What a hostile peer holding `pool` manages: truncate each fd, reopen it writable."""
    out: dict[str, object] = {}
    for fd in fds_of(pool):
        try:
            os.ftruncate(fd, 0)
            out["ftruncate"] = "truncated"
        except OSError as exc:
            out["ftruncate"] = errno.errorcode[exc.errno or 0]
        try:
            again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        except OSError as exc:
            out["reopen"] = errno.errorcode[exc.errno or 0]
            continue
        try:
            os.ftruncate(again, 0)
            out["reopen"] = "truncated"
        except OSError as exc:
            out["reopen"] = f"opened, {errno.errorcode[exc.errno or 0]}"
        finally:
            os.close(again)
    return out


def test_ungranted_uid_gets_readonly_and_cannot_shrink_the_owner(public_dir: str) -> None:
    path = os.path.join(public_dir, "s", "pool.sock")
    server = Server(path, os.path.join(public_dir, "events.log"), allowed_uids=[NOBODY])
    try:

        def peer() -> str:
            result: dict[str, object] = {}
            try:
                attach(path, "fallback", readonly=False, allow_unsealed=True)
                result["write"] = "granted"
            except ShareError as exc:
                result["write"] = str(exc)
            h = attach(path, "fallback", allow_unsealed=True)  # what the server grants
            result["readonly"] = h.manifest["readonly"]
            result["sum"] = int(h.tensors[0].sum())
            result.update(_try_to_shrink("fallback"))
            h.close()
            return json.dumps(result)

        code, out = helpers.run_forked(peer, uid=NOBODY)
        assert code == 0, out
        result = json.loads(out)
        assert "not granted write access" in str(result["write"])
        assert result["readonly"] is True and result["sum"] == MiB
        assert result["ftruncate"] == "EINVAL"  # an O_RDONLY fd cannot truncate
        assert result["reopen"] == "EACCES"  # 0600, owned by the server's uid
        assert server.touch() == FULL_SUM  # the owner reads every page: no SIGBUS
    finally:
        assert server.stop() == 0


def test_write_grant_only_for_memfds_sealed_against_shrinking(public_dir: str) -> None:
    path = os.path.join(public_dir, "s", "pool.sock")
    log = os.path.join(public_dir, "events.log")
    server = Server(path, log, allowed_uids=[NOBODY], writable_uids=[NOBODY])
    try:

        def peer() -> str:
            result: dict[str, object] = {}
            with attach(path, "sealed", readonly=False) as h:
                h.tensors[0][:4096].fill_(7)  # granted: writes reach the owner
                result["sealed"] = _try_to_shrink("sealed")
            try:
                attach(path, "fallback", readonly=False, allow_unsealed=True)
                result["fallback_write"] = "granted"
            except ShareError as exc:
                result["fallback_write"] = str(exc)
            with attach(path, "fallback", allow_unsealed=True) as h:
                result["fallback_any"] = [h.manifest["readonly"], h.manifest["reason"]]
                result["fallback"] = _try_to_shrink("fallback")
            return json.dumps(result)

        code, out = helpers.run_forked(peer, uid=NOBODY)
        assert code == 0, out
        result = json.loads(out)
        # The sealed memfd: writable, and the kernel refuses to shrink it.
        assert result["sealed"]["ftruncate"] == "EPERM"
        # The /dev/shm file cannot be sealed: never writable, read-only with the reason.
        assert "writable sharing refused" in result["fallback_write"]
        readonly, reason = result["fallback_any"]
        assert readonly is True and "not sealed against shrinking" in reason
        assert result["fallback"] == {"ftruncate": "EINVAL", "reopen": "EACCES"}
        assert server.touch() == FULL_SUM + 4096 * (7 - 2)  # the peer's writes, no SIGBUS
        logged = server.events()
        assert "hostpool.share_readonly" in logged and "not sealed against shrinking" in logged
    finally:
        assert server.stop() == 0
