"""The broker: `hostpool serve`'s share server, which also lends its pools.

`Broker` is a `PoolShareServer` (same socket, same SO_PEERCRED check: only this uid and
`allowed_uids` connect; same `list`/`attach`/`detach`) with three more requests:

- `lease` {pool, part: "memory"}: the pool's regions, writable, as `attach` sends them
  (a manifest, then the fds), to one connection at a time. A second lease is refused
  naming the holder's pid. The lease lives as long as the connection (or until a
  `detach` of the pool): when the engine dies the kernel closes its socket, the loop
  sees it, the lease ends, and the memory, with what the engine wrote, stays here.
- `lease` {pool, part: "index", index_bytes}: the pool's metadata memfd (created at the
  first such lease, sealed against resizing, kept across leases; a lease asking another
  size gets a fresh one, the old one's valid records counted `resized`), to one
  connection at a time: the engine's scheduler, which may be another process than the
  worker that leases the memory.
- `lease_report` {pool, adopted, discarded: {reason: n}, reason, field}: what the index
  lessee adopted at its start, for the ledger of events and the metrics.

Nothing of a lease survives this process: a broker restart is cold (its pools are new).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any

from hostpool.base import events
from hostpool.broker.index import valid_records
from hostpool.core.leases import PARTS, Holder, LeaseHeldError
from hostpool.core.manager import PoolManager
from hostpool.errors import ShareError
from hostpool.memory.shm import ShmFile, create_memfd, next_name, size_and_seal
from hostpool.share import protocol
from hostpool.share.loop import Peer
from hostpool.share.server import Packets, PoolShareServer

MAX_INDEX_BYTES = 1 << 30
INDEX_SUFFIX = "/index"  # peer.pools key of an index lease: no pool name has a "/"


class Broker(PoolShareServer):
    """A share server that lends its pools (module doc). `book` holds the leases: the
    manager's lease ledger (`manager.leases`), so /debug/pools shows them."""

    def __init__(self, manager: PoolManager, path: str, **options: Any) -> None:
        super().__init__(manager, path, **options)
        self.book = manager.leases
        self._indexes: dict[str, ShmFile] = {}  # pool -> its metadata memfd
        self._closing: set[int] = set()  # peers whose connection is ending

    def start(self) -> Broker:
        super().start()
        events.info(
            "hostpool.broker_started",
            path=self.path,
            pools=sorted(self.manager.pools),
            cold="every pool is new: no lease, index or content of an earlier broker is kept",
        )
        return self

    def close(self) -> None:
        super().close()
        for shm in self._indexes.values():
            with contextlib.suppress(OSError):
                os.close(shm.fd)
        self._indexes.clear()

    # -- requests --------------------------------------------------------------------
    def _handle(self, peer: Peer, message: dict[str, Any]) -> Packets:
        op = message.get("op")
        if op == "lease":
            return self._lease(peer, message)
        if op == "lease_report":
            return self._report(peer, message)
        return super()._handle(peer, message)

    def _lease(self, peer: Peer, message: dict[str, Any]) -> Packets:
        pool, part = message.get("pool"), message.get("part", "memory")
        if not isinstance(pool, str) or part not in PARTS:
            raise protocol.ProtocolError(f"lease needs pool (string) and part {PARTS}")
        size = message.get("index_bytes")
        if part == "index" and (
            not isinstance(size, int)
            or isinstance(size, bool)
            or not 0 < size <= MAX_INDEX_BYTES
            or size % mmap.PAGESIZE
        ):
            return _refused(
                peer, pool, f"index_bytes must be whole pages, at most {MAX_INDEX_BYTES}"
            )
        if self.manager.allocator_for(pool) is None:
            return _refused(peer, pool, f"no pool {pool!r} here: {sorted(self.manager.pools)}")
        try:
            holder = self.book.take(pool, part, peer=peer.id, pid=peer.pid, uid=peer.uid)
        except LeaseHeldError as exc:
            return _refused(peer, pool, str(exc), holder_pid=exc.holder.pid)
        try:
            if part == "memory":
                packets = self._lend_memory(peer, pool, holder)
            else:
                packets = self._lend_index(peer, pool, int(size or 0))
        except BaseException:
            self.book.end(peer.id, pool, part)
            raise
        if not protocol.decode(packets[0][0]).get("ok"):
            self.book.end(peer.id, pool, part)
            return packets
        events.info("hostpool.broker_lease", pool=pool, part=part, pid=peer.pid, uid=peer.uid)
        return packets

    def _lend_memory(self, peer: Peer, pool: str, holder: Holder) -> Packets:
        packets = self._attach(peer, pool, "write")
        head = protocol.decode(packets[0][0])
        if head.get("ok"):
            head.pop("v", None)
            head["lease"] = {"part": "memory", "since": holder.since}
            packets[0] = (protocol.encode(head), packets[0][1])
        return packets

    def _lend_index(self, peer: Peer, pool: str, size: int) -> Packets:
        shm = self._indexes.get(pool)
        if shm is not None and os.fstat(shm.fd).st_size != size:
            with mmap.mmap(shm.fd, os.fstat(shm.fd).st_size, prot=mmap.PROT_READ) as old:
                dropped = valid_records(old)
            if dropped:
                self.book.count(pool, 0, {"resized": dropped})
            events.info("hostpool.broker_index_resized", pool=pool, discarded=dropped)
            os.close(shm.fd)
            del self._indexes[pool]
            shm = None
        if shm is None:
            shm = create_memfd(next_name("hostpool.", f"{pool}-index"))
            try:
                size_and_seal(shm, size, seal=True)
            except BaseException:
                os.close(shm.fd)
                raise
            self._indexes[pool] = shm
        fd = self._with_fds(peer, lambda: os.dup(shm.fd))
        peer.pools[pool + INDEX_SUFFIX] = []  # held: no request deadline, never evicted
        head = {"ok": True, "pool": pool, "lease": {"part": "index"}, "bytes": size}
        return [(protocol.encode(head), []), (protocol.encode({"op": "fds", "index": 0}), [fd])]

    def _report(self, peer: Peer, message: dict[str, Any]) -> Packets:
        pool = message.get("pool")
        adopted, discarded = message.get("adopted"), message.get("discarded")
        if (
            not isinstance(pool, str)
            or not isinstance(adopted, int)
            or not isinstance(discarded, dict)
            or not all(isinstance(n, int) for n in discarded.values())
        ):
            raise protocol.ProtocolError("lease_report needs pool, adopted, discarded")
        holder = self.book.holder(pool, "index")
        if holder is None or holder.peer != peer.id:
            return _refused(peer, pool, f"this connection does not lease the index of {pool!r}")
        try:
            self.book.count(pool, adopted, discarded)
        except ShareError as exc:
            return _refused(peer, pool, str(exc))
        events.info(
            "hostpool.broker_adopted",
            pool=pool,
            pid=peer.pid,
            blocks=adopted,
            discarded=discarded,
            reason=_text(message.get("reason")),
            field=_text(message.get("field")),
        )
        return [(protocol.encode({"ok": True}), [])]

    # -- ends ------------------------------------------------------------------------
    def _detach(self, peer: Peer, pool: str) -> None:
        name, _, index = pool.partition("/")
        super()._detach(peer, pool)
        for holder in self.book.end(peer.id, name, "index" if index else "memory"):
            events.info(
                "hostpool.broker_lease_ended",
                pool=holder.pool,
                part=holder.part,
                pid=holder.pid,
                uid=holder.uid,
                how="connection closed" if peer.id in self._closing else "detach",
                kept="the memory and its contents stay with the broker",
            )

    def _gone(self, peer: Peer) -> None:
        self._closing.add(peer.id)
        try:
            super()._gone(peer)
        finally:
            self._closing.discard(peer.id)


def _text(value: object) -> str | None:
    """A lessee's free text, bounded (None stays None)."""
    return None if value is None else str(value)[:200]


def _refused(peer: Peer, pool: str, reason: str, **fields: Any) -> Packets:
    events.warning(
        "hostpool.broker_lease_refused",
        pool=pool,
        pid=peer.pid,
        uid=peer.uid,
        reason=reason,
        **fields,
    )
    return [(protocol.encode({"ok": False, "error": reason}), [])]
