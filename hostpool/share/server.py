"""PoolShareServer: hands a pool's fds and a manifest to authorised peers.

Every connection is checked with SO_PEERCRED; by default only this process's uid may
connect (the socket is 0600 in a 0700 directory). Each connection has its own thread and
never holds a hostpool lock while sending, so a slow peer slows only itself.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
import stat
import struct
import threading
from collections.abc import Iterable
from typing import Any

from hostpool import events
from hostpool.errors import ConfigError
from hostpool.lifecycle import Ledger, get_ledger
from hostpool.manager import HostPoolManager
from hostpool.memory.region import Region
from hostpool.share import protocol

SEND_TIMEOUT = 5.0


class PoolShareServer:
    def __init__(
        self,
        manager: HostPoolManager,
        path: str,
        *,
        allowed_uids: Iterable[int] | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.manager = manager
        self.path = os.path.abspath(path)
        self.allowed_uids = frozenset(allowed_uids or ()) | {os.geteuid()}
        self._open_to_others = bool(allowed_uids)
        self.ledger = ledger or get_ledger()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._attached: dict[str, set[int]] = {}
        self._held: dict[int, dict[str, list[int]]] = {}  # conn -> pool -> region ids
        self._conn_ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._sock: socket.socket | None = None
        self._created_dir = False

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> PoolShareServer:
        directory = os.path.dirname(self.path)
        dir_mode = 0o711 if self._open_to_others else 0o700
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=dir_mode)
            self._created_dir = True
        st = os.stat(directory)
        if st.st_uid != os.geteuid():
            raise ConfigError(
                f"share socket directory {directory} belongs to uid {st.st_uid}: use a "
                "directory of this user (its mode is set to 0700, or 0711 with allowed_uids)"
            )
        os.chmod(directory, dir_mode)
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # a stale socket from a dead server
            else:
                raise ConfigError(f"{self.path} exists and is not a socket; not replacing it")
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.bind(self.path)
        os.chmod(self.path, 0o666 if self._open_to_others else 0o600)
        sock.listen(64)
        sock.settimeout(0.2)
        self._sock = sock
        self.ledger.share_clients = self.attached_counts
        thread = threading.Thread(target=self._accept_loop, name="hostpool-share", daemon=True)
        thread.start()
        self._threads.append(thread)
        events.info(
            "hostpool.share_listening", path=self.path, allowed_uids=sorted(self.allowed_uids)
        )
        return self

    def close(self) -> None:
        self._stop.set()
        for thread in list(self._threads):
            thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._created_dir:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))
        if self.ledger.share_clients == self.attached_counts:
            self.ledger.share_clients = None

    def __enter__(self) -> PoolShareServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attached_counts(self) -> dict[str, int]:
        """Peers attached per pool (feeds hostpool_attached_clients)."""
        with self._lock:
            return {pool: len(conns) for pool, conns in self._attached.items()}

    # -- connections -----------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            pid, uid, _gid = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            )
            if uid not in self.allowed_uids:
                events.warning("hostpool.share_refused", pid=pid, uid=uid, reason="uid not allowed")
                conn.close()
                continue
            conn_id = next(self._conn_ids)
            thread = threading.Thread(
                target=self._serve,
                args=(conn, conn_id, pid, uid),
                daemon=True,
                name=f"hostpool-share-{conn_id}",
            )
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket, conn_id: int, pid: int, uid: int) -> None:
        conn.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT), 0)
        )
        conn.settimeout(0.5)
        try:
            while not self._stop.is_set():
                try:
                    message, _, _ = protocol.receive(conn)
                except TimeoutError:
                    continue
                self._handle(conn, conn_id, message)
        except (ConnectionError, OSError) as exc:
            if not isinstance(exc, ConnectionError) and exc.errno not in (errno.EPIPE, errno.EBADF):
                events.info("hostpool.share_peer_error", pid=pid, error=str(exc))
        except protocol.ProtocolError as exc:
            events.warning("hostpool.share_malformed", pid=pid, uid=uid, error=str(exc))
        finally:
            conn.close()
            self._detach_all(conn_id)
            events.info("hostpool.share_peer_gone", pid=pid)

    def _handle(self, conn: socket.socket, conn_id: int, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "list":
            protocol.send(conn, {"ok": True, "pools": self._list()})
        elif op == "attach":
            pool = message.get("pool")
            readonly = message.get("readonly", False)
            if not isinstance(pool, str) or not isinstance(readonly, bool):
                raise protocol.ProtocolError("attach needs pool (string) and readonly (bool)")
            self._attach(conn, conn_id, pool, readonly)
        elif op == "detach":
            pool = message.get("pool")
            if not isinstance(pool, str):
                raise protocol.ProtocolError("detach needs pool (string)")
            self._detach(conn_id, pool)
            protocol.send(conn, {"ok": True})
        else:
            raise protocol.ProtocolError(f"unknown op {op!r}")

    # -- operations ------------------------------------------------------------------
    def _regions(self, pool: str) -> list[tuple[Region, Any]]:
        allocator = self.manager.allocator_for(pool)
        if allocator is None:
            return []
        return [
            (e.region, e)
            for e in self.ledger.entries(owner=allocator._id)
            if e.state == "live" and e.region.kind == "shm"
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
                        "bytes": sum(r.mapped_bytes for r, _ in regions),
                    }
                )
        return out

    def _attach(self, conn: socket.socket, conn_id: int, pool: str, readonly: bool) -> None:
        fds: list[int] = []
        manifest: list[dict[str, Any]] = []
        try:
            for region, entry in self._regions(pool):
                fd = region.borrow_fd()
                if fd is None:
                    continue  # released meanwhile
                if readonly:
                    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
                    os.close(fd)
                    fd = ro
                fds.append(fd)
                manifest.append(
                    {
                        "id": region.id,
                        "name": region.name,
                        "dims": list(entry.dims),
                        "dtype": entry.dtype,
                        "layout": "contiguous",
                        "bytes": region.mapped_bytes,
                        "requested_bytes": region.requested_bytes,
                        "page_size": region.page_size,
                        "seals": region.seals,
                        "backend": region.backend,
                    }
                )
            if not manifest:
                protocol.send(conn, {"ok": False, "error": f"no shareable pool {pool!r}"})
                return
            packets = [
                fds[i : i + protocol.MAX_FDS_PER_PACKET]
                for i in range(0, len(fds), protocol.MAX_FDS_PER_PACKET)
            ]
            with self._lock:
                self._attached.setdefault(pool, set()).add(conn_id)
                held = self._held.setdefault(conn_id, {})
                held[pool] = [m["id"] for m in manifest]
            self._update_peers(m["id"] for m in manifest)
            protocol.send(
                conn,
                {
                    "ok": True,
                    "pool": pool,
                    "readonly": readonly,
                    "generation": max(m["id"] for m in manifest),
                    "regions": manifest,
                    "fd_packets": len(packets),
                },
            )
            for index, chunk in enumerate(packets):
                protocol.send(conn, {"op": "fds", "index": index}, chunk)
            events.info(
                "hostpool.share_attach", pool=pool, regions=len(manifest), readonly=readonly
            )
        finally:
            protocol.close_all(fds)

    def _detach(self, conn_id: int, pool: str) -> None:
        with self._lock:
            conns = self._attached.get(pool, set())
            conns.discard(conn_id)
            ids = self._held.get(conn_id, {}).pop(pool, [])
        self._update_peers(ids)

    def _detach_all(self, conn_id: int) -> None:
        with self._lock:
            pools = list(self._held.get(conn_id, {}))
        for pool in pools:
            self._detach(conn_id, pool)
        with self._lock:
            self._held.pop(conn_id, None)

    def _update_peers(self, region_ids: Iterable[int]) -> None:
        ids = list(region_ids)
        with self._lock:
            counts = {
                rid: sum(
                    1
                    for held in self._held.values()
                    for pool_ids in held.values()
                    if rid in pool_ids
                )
                for rid in ids
            }
        for rid, n in counts.items():
            self.ledger.set_peers(rid, n)
