"""PoolShareServer: hands a pool's fds and a manifest to authorised peers.

Every connection is checked with SO_PEERCRED: only this uid and `allowed_uids` may
connect (the socket is 0600 in a private directory unless other uids are allowed). The
server, not the peer, decides each uid's access (`hostpool.share.access`): read-only
unless the uid is in `writable_uids`, and writable only for memfds sealed against
shrinking. Connections are served by one event loop with caps and deadlines
(`hostpool.share.loop`); the socket's path is claimed and given back by
`hostpool.share.socketpath`. No hostpool lock is held while sending.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, Self

from hostpool.base import events
from hostpool.core.ledger import Ledger, get_ledger
from hostpool.core.manager import PoolManager
from hostpool.errors import ShareError
from hostpool.memory.interface import RegionLike
from hostpool.net.guard import FD_SHORTAGE
from hostpool.share import peers, protocol
from hostpool.share.access import AccessPolicy, Grant
from hostpool.share.loop import Limits, Peer, ShareLoop
from hostpool.share.socketpath import SocketPath

Packets = list[tuple[bytes, list[int]]]
BACKLOG = 512  # queued connections cost no fd; a legitimate one waits there in a flood


class PoolShareServer:
    def __init__(
        self,
        manager: PoolManager,
        path: str,
        *,
        allowed_uids: Iterable[int] | None = None,
        writable_uids: Iterable[int] | None = None,
        max_connections: int | None = None,
        max_connections_per_uid: int | None = None,
        request_timeout: float = 10.0,
        send_timeout: float = 5.0,
        ledger: Ledger | None = None,
    ) -> None:
        """`allowed_uids` may attach read-only, `writable_uids` also writable (this process's
        uid is both). Connections are capped in total (default: a quarter of
        RLIMIT_NOFILE, at most 256) and per uid (a quarter of that); a connection must send
        a request within `request_timeout` seconds unless it holds an attachment."""
        self.manager = manager
        self.policy = AccessPolicy(allowed_uids or (), writable_uids or ())
        self.allowed_uids = self.policy.allowed
        self.limits = Limits.default(
            max_connections, max_connections_per_uid, request_timeout, send_timeout
        )
        self._where = SocketPath(path, open_to_others=bool(self.allowed_uids - {os.geteuid()}))
        self.path = self._where.path
        self.ledger = ledger or get_ledger()
        self._lock = threading.Lock()
        self._attached: dict[str, set[int]] = {}  # pool -> peer ids
        self._held: dict[int, dict[str, list[int]]] = {}  # peer id -> pool -> region ids
        self._loop: ShareLoop | None = None

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> Self:
        """Listen; raises ShareSocketInUseError when a server answers at the path already,
        ConfigError for a path or directory that is not safe to use."""
        listener = self._where.listen(BACKLOG)
        self._loop = ShareLoop(
            listener,
            allowed=self.policy.may_connect,
            handler=self._handle,
            on_close=self._gone,
            limits=self.limits,
        )
        peers.add_source(self.ledger, self.attached_counts)
        self._loop.start()
        events.info(
            "hostpool.share_listening",
            path=self.path,
            allowed_uids=sorted(self.allowed_uids),
            writable_uids=sorted(self.policy.writable),
            max_connections=self.limits.max_connections,
            max_connections_per_uid=self.limits.max_per_uid,
        )
        return self

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.stop()
            loop.listener.close()
            peers.remove_source(self.ledger, self.attached_counts)
        self._where.release()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attached_counts(self) -> dict[str, int]:
        """Peers attached per pool (feeds hostpool_attached_clients)."""
        with self._lock:
            return {pool: len(peers) for pool, peers in self._attached.items()}

    # -- requests (on the loop's thread) ---------------------------------------------
    def _handle(self, peer: Peer, message: dict[str, Any]) -> Packets:
        op = message.get("op")
        if op == "list":
            return [(protocol.encode({"ok": True, "pools": self._list()}), [])]
        if op == "attach":
            pool, access = message.get("pool"), message.get("access")
            if not isinstance(pool, str) or access not in protocol.ACCESS:
                raise protocol.ProtocolError(
                    "attach needs pool (string) and access (read|write|any)"
                )
            return self._attach(peer, pool, str(access))
        if op == "detach":
            pool = message.get("pool")
            if not isinstance(pool, str):
                raise protocol.ProtocolError("detach needs pool (string)")
            self._detach(peer, pool)
            return [(protocol.encode({"ok": True}), [])]
        raise protocol.ProtocolError(f"unknown op {op!r}")

    def _regions(self, pool: str) -> list[tuple[RegionLike, Any]]:
        allocator = self.manager.allocator_for(pool)
        if allocator is None:
            return []
        return [
            (e.region, e)
            for e in self.ledger.entries(owner=allocator.owner_id)
            if e.state == "live" and e.region.facts.kind == "shm"
        ]

    def _list(self) -> list[dict[str, Any]]:
        out = []
        for pool in self.manager.pools:
            regions = self._regions(pool)
            if regions:
                out.append(
                    {
                        "pool": pool,
                        "regions": len(regions),
                        "bytes": sum(r.facts.mapped_bytes for r, _ in regions),
                    }
                )
        return out

    def _attach(self, peer: Peer, pool: str, access: str) -> Packets:
        if pool in peer.pools:
            return _refusal(f"pool {pool!r} is already attached on this connection")
        fds: list[int] = []
        handed = False  # once the packets hold the fds, the loop's outbox closes them
        try:
            try:
                manifest, named = self._borrow(peer, pool)
            except OSError as exc:
                return self._failed(
                    peer, pool, f"server cannot open the pool's fds: {exc.strerror}"
                )
            fds = [fd for _, fd in named]
            if not manifest:
                return _refusal(f"no shareable pool {pool!r}")
            try:
                grant = self.policy.decide(peer.uid, access, named)
            except ShareError as exc:
                return self._failed(peer, pool, str(exc))
            if grant.readonly:
                # _reopen_readonly closes the dups it is given, on every path
                dups, fds = fds, []
                fds = self._reopen_readonly(peer, dups)
            if grant.reason is not None:  # an unsealed region is news; a policy is not
                events.emit(
                    "hostpool.share_readonly",
                    logging.WARNING if grant.unsafe else logging.INFO,
                    pool=pool,
                    pid=peer.pid,
                    uid=peer.uid,
                    reason=grant.reason,
                )
            packets = self._packets(pool, manifest, fds, grant)
            handed = True
        finally:
            # Every refusal and failure above returns or raises with borrowed fds open.
            if not handed:
                protocol.close_all(fds)
        ids = [m["id"] for m in manifest]
        peer.pools[pool] = ids
        with self._lock:
            self._attached.setdefault(pool, set()).add(peer.id)
            self._held.setdefault(peer.id, {})[pool] = ids
        self._update_peers(ids)
        events.info(
            "hostpool.share_attach",
            pool=pool,
            pid=peer.pid,
            uid=peer.uid,
            regions=len(manifest),
            readonly=grant.readonly,
        )
        return packets

    def _borrow(self, peer: Peer, pool: str) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
        """The pool's manifest and a verified dup of each region's fd (the caller closes)."""
        manifest: list[dict[str, Any]] = []
        named: list[tuple[str, int]] = []
        try:
            for region, entry in self._regions(pool):
                fd = self._with_fds(peer, region.borrow_fd)
                if fd is None:  # released since the manager listed it
                    continue
                facts = region.facts
                named.append((facts.name or str(facts.id), fd))
                manifest.append(
                    {
                        "id": facts.id,
                        "name": facts.name,
                        "dims": list(entry.dims),
                        "dtype": entry.dtype,
                        "layout": "contiguous",
                        "bytes": facts.mapped_bytes,
                        "requested_bytes": facts.requested_bytes,
                        "page_size": facts.page_size,
                        "seals": facts.seals,
                        "backend": facts.backend,
                    }
                )
        except BaseException:
            protocol.close_all([fd for _, fd in named])
            raise
        return manifest, named

    def _reopen_readonly(self, peer: Peer, fds: list[int]) -> list[int]:
        """O_RDONLY fds of the same inodes (replacing, and closing, `fds`)."""
        out: list[int] = []
        try:
            for fd in fds:
                out.append(self._with_fds(peer, functools.partial(_open_readonly, fd)))
        except BaseException:
            protocol.close_all(out)
            raise
        finally:
            protocol.close_all(fds)
        return out

    def _with_fds(self, peer: Peer, opener: Callable[[], Any]) -> Any:
        """Run `opener`; on fd exhaustion close an idle connection (not `peer`) and retry."""
        while True:
            try:
                return opener()
            except OSError as exc:
                loop = self._loop
                if exc.errno not in FD_SHORTAGE or loop is None:
                    raise
                if not loop.evict_one("fd limit reached while serving an attach", spare=peer):
                    raise

    def _packets(
        self, pool: str, manifest: list[dict[str, Any]], fds: list[int], grant: Grant
    ) -> Packets:
        chunks = [
            fds[i : i + protocol.MAX_FDS_PER_PACKET]
            for i in range(0, len(fds), protocol.MAX_FDS_PER_PACKET)
        ]
        head = {
            "ok": True,
            "pool": pool,
            "readonly": grant.readonly,
            "reason": grant.reason,
            "generation": max(m["id"] for m in manifest),
            "regions": manifest,
            "fd_packets": len(chunks),
        }
        packets: Packets = [(protocol.encode(head), [])]
        packets += [(protocol.encode({"op": "fds", "index": i}), c) for i, c in enumerate(chunks)]
        return packets

    def _failed(self, peer: Peer, pool: str, reason: str) -> Packets:
        events.warning(
            "hostpool.share_refused", pool=pool, pid=peer.pid, uid=peer.uid, reason=reason
        )
        return _refusal(reason)

    # -- detaching -------------------------------------------------------------------
    def _detach(self, peer: Peer, pool: str) -> None:
        ids = peer.pools.pop(pool, [])
        with self._lock:
            self._attached.get(pool, set()).discard(peer.id)
            self._held.get(peer.id, {}).pop(pool, None)
        self._update_peers(ids)

    def _gone(self, peer: Peer) -> None:
        pools = list(peer.pools)
        for pool in pools:
            self._detach(peer, pool)
        with self._lock:
            self._held.pop(peer.id, None)
        if pools:  # connections that never attached come and go in floods: not news
            events.info("hostpool.share_peer_gone", pid=peer.pid, uid=peer.uid, pools=pools)

    def _update_peers(self, region_ids: Iterable[int]) -> None:
        ids = list(region_ids)
        with self._lock:
            counts = {
                rid: sum(1 for held in self._held.values() for got in held.values() if rid in got)
                for rid in ids
            }
        for rid, n in counts.items():
            self.ledger.set_peers(rid, n)


def _open_readonly(fd: int) -> int:
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def _refusal(reason: str) -> Packets:
    return [(protocol.encode({"ok": False, "error": reason}), [])]
