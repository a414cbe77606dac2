"""The share socket's event loop: one thread, every connection bounded in number and time.

A peer costs one fd and a small record, never a thread, so a flood of idle connections
cannot starve a legitimate attach. What the loop enforces:

The policy is the one of `hostpool.net.guard`, shared with the HTTP listener:

- caps per uid and in total (the total defaults to a quarter of RLIMIT_NOFILE, so the
  host application keeps its fds): at a cap, the oldest connection that holds nothing
  (no attachment, no reply in flight) is closed to make room; if every one holds
  something, the newcomer is refused;
- deadlines: a connection must send a request within `request_timeout` of connecting
  or of its last reply unless it holds an attachment (an attached peer may stay quiet
  for as long as it maps the pool); a reply must drain within `send_timeout`;
- fd exhaustion (EMFILE/ENFILE at accept or while building a reply) closes the oldest
  idle connection and retries, else pauses accepting with exponential back-off (never a
  busy loop);
- every error of one connection (malformed, reset, a bug in a handler) ends that
  connection with an event; the loop keeps serving the others.

Events about floods (refusals, evictions, timeouts) are throttled per kind and uid: one
per second, with the number folded into it.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hostpool.base import events
from hostpool.errors import ConfigError
from hostpool.net import guard
from hostpool.share import protocol

ACCEPT_BATCH = 64
BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0
_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Limits:
    """Bounds on the connections one share server keeps."""

    max_connections: int
    max_per_uid: int
    request_timeout: float = 10.0
    send_timeout: float = 5.0

    @classmethod
    def default(
        cls,
        max_connections: int | None = None,
        max_per_uid: int | None = None,
        request_timeout: float = 10.0,
        send_timeout: float = 5.0,
    ) -> Limits:
        if max_connections is None:
            max_connections = guard.connection_cap(256, 4)
        if max_per_uid is None:
            max_per_uid = max(1, max_connections // 4)
        if max_connections < 1 or max_per_uid < 1 or request_timeout <= 0 or send_timeout <= 0:
            raise ConfigError(
                "share server limits must be positive: max_connections="
                f"{max_connections}, max_connections_per_uid={max_per_uid}, "
                f"request_timeout={request_timeout}, send_timeout={send_timeout}"
            )
        return cls(
            max_connections, min(max_per_uid, max_connections), request_timeout, send_timeout
        )


@dataclass(eq=False)
class Peer:
    """One accepted connection: who it is, what it holds, what it owes, when it expires."""

    sock: socket.socket
    id: int
    pid: int
    uid: int
    accepted: float
    deadline: float | None
    outbox: collections.deque[tuple[bytes, list[int]]] = field(default_factory=collections.deque)
    pools: dict[str, list[int]] = field(default_factory=dict)  # attached pool -> region ids
    blocked: bool = False  # waiting for the peer to read a reply

    @property
    def idle(self) -> bool:
        """Holds nothing a close would take away from a legitimate peer."""
        return not self.pools and not self.outbox


# message from a peer -> packets to send back (encoded, with fds the outbox then owns)
Handler = Callable[[Peer, dict[str, Any]], list[tuple[bytes, list[int]]]]


class ShareLoop:
    """Accepts on `listener`, reads one request at a time per peer, sends what `handler`
    returns, and calls `on_close(peer)` exactly once per admitted peer."""

    def __init__(
        self,
        listener: socket.socket,
        *,
        allowed: Callable[[int], bool],
        handler: Handler,
        on_close: Callable[[Peer], None],
        limits: Limits,
    ) -> None:
        self.listener = listener
        self.allowed = allowed
        self.handler = handler
        self.on_close = on_close
        self.limits = limits
        self.peers: dict[int, Peer] = {}  # by Peer.id
        self.throttle = guard.Throttle()
        self._ids = 0
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listening = False
        self._backoff = guard.Backoff(BACKOFF_MIN, BACKOFF_MAX)
        self._resume_at = 0.0

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self.listener.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._listen(True)
        self._thread = threading.Thread(target=self._run, name="hostpool-share", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, mask in self._selector.select(self._timeout()):
                    if key.fileobj is self._wake_r:
                        self._drain_wake()
                    elif key.fileobj is self.listener:
                        self._guarded(self._accept_some)
                    else:
                        self._ready(key.data, mask)
                now = time.monotonic()
                self._expire(now)
                if not self._listening and now >= self._resume_at:
                    self._listen(True)
                self.throttle.flush()
        finally:
            for peer in list(self.peers.values()):
                self.drop(peer)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _guarded(self, step: Callable[[], None]) -> None:
        """Run a step of the loop; a bug in it is logged once, and the loop goes on."""
        try:
            step()
        except Exception as exc:
            events.emit(
                "hostpool.share_internal_error", logging.ERROR, error=repr(exc), exc_info=True
            )
            time.sleep(0.05)  # a bug that repeats must not spin a core either

    def _timeout(self) -> float:
        now = time.monotonic()
        wake = now + self.throttle.interval
        if not self._listening:
            wake = min(wake, self._resume_at)
        for peer in self.peers.values():
            if peer.deadline is not None:
                wake = min(wake, peer.deadline)
        return max(0.0, wake - now)

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(64)

    def _listen(self, on: bool) -> None:
        if on and not self._listening:
            self._selector.register(self.listener, selectors.EVENT_READ, None)
        elif not on and self._listening:
            self._selector.unregister(self.listener)
        self._listening = on

    # -- accepting -------------------------------------------------------------------
    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                if exc.errno in guard.FD_SHORTAGE and self.evict_one("fd limit reached"):
                    continue
                self._pause(exc)
                return
            self._backoff.reset()
            self._admit(conn)

    def _pause(self, exc: OSError) -> None:
        """Stop accepting for a while: the pending connection stays queued in the kernel."""
        pause = self._backoff.next()
        self._resume_at = time.monotonic() + pause
        self._listen(False)
        self.throttle.warning(
            "hostpool.share_accept_paused",
            exc.errno,
            error=exc.strerror,
            seconds=pause,
            connections=len(self.peers),
        )

    def _admit(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            pid, uid, _gid = _PEERCRED.unpack(raw)
        except OSError:
            conn.close()
            return
        if not self.allowed(uid):
            self.throttle.warning(
                "hostpool.share_refused", uid, pid=pid, uid=uid, reason="uid not allowed"
            )
            conn.close()
            return
        if not self._make_room(uid):
            self.throttle.warning(
                "hostpool.share_refused",
                uid,
                pid=pid,
                uid=uid,
                reason="connection cap reached and every connection holds an attachment",
            )
            conn.close()
            return
        self._ids += 1
        now = time.monotonic()
        peer = Peer(conn, self._ids, pid, uid, now, now + self.limits.request_timeout)
        self.peers[peer.id] = peer
        self._selector.register(conn, selectors.EVENT_READ, peer)

    def _make_room(self, uid: int) -> bool:
        mine = [p for p in self.peers.values() if p.uid == uid]
        if len(mine) >= self.limits.max_per_uid and not self.evict_one(
            "connection cap per uid reached", among=mine
        ):
            return False
        if len(self.peers) >= self.limits.max_connections:
            return self.evict_one("connection cap reached")
        return True

    def evict_one(
        self, reason: str, among: Iterable[Peer] | None = None, spare: Peer | None = None
    ) -> bool:
        """Close the oldest connection that holds nothing; False if there is none."""
        # peers and `among` are in the order they were accepted: oldest first
        victim = guard.oldest_idle(
            list(self.peers.values() if among is None else among),
            lambda p: p.idle and p is not spare,
        )
        if victim is None:
            return False
        self.throttle.warning("hostpool.share_evicted", victim.uid, uid=victim.uid, reason=reason)
        self.drop(victim)
        return True

    # -- serving ---------------------------------------------------------------------
    def _ready(self, peer: Peer, mask: int) -> None:
        if self.peers.get(peer.id) is not peer:
            return  # closed earlier in this round (evicted to make room)
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(peer)
            if mask & selectors.EVENT_READ and not peer.outbox:
                self._read(peer)
        except protocol.ProtocolError as exc:
            events.warning("hostpool.share_malformed", pid=peer.pid, uid=peer.uid, error=str(exc))
            self.drop(peer)
        except ConnectionError:
            self.drop(peer)
        except OSError as exc:
            events.info("hostpool.share_peer_error", pid=peer.pid, uid=peer.uid, error=str(exc))
            self.drop(peer)
        except Exception as exc:  # a bug must cost one connection, not the server
            events.emit(
                "hostpool.share_internal_error",
                logging.ERROR,
                pid=peer.pid,
                uid=peer.uid,
                error=repr(exc),
                exc_info=True,
            )
            self.drop(peer)

    def _read(self, peer: Peer) -> None:
        try:
            message, _, _ = protocol.receive(peer.sock, limit=protocol.MAX_REQUEST)
        except BlockingIOError:
            return
        peer.outbox.extend(self.handler(peer, message))
        self._flush(peer)

    def _flush(self, peer: Peer) -> None:
        while peer.outbox:
            data, fds = peer.outbox[0]
            try:
                protocol.send_packet(peer.sock, data, fds)
            except BlockingIOError:
                if not peer.blocked:  # the deadline runs from the first refusal to take it
                    peer.blocked = True
                    peer.deadline = time.monotonic() + self.limits.send_timeout
                    self._selector.modify(peer.sock, selectors.EVENT_WRITE, peer)
                return
            peer.outbox.popleft()
            protocol.close_all(fds)
        if peer.blocked:
            peer.blocked = False
            self._selector.modify(peer.sock, selectors.EVENT_READ, peer)
        peer.deadline = None if peer.pools else time.monotonic() + self.limits.request_timeout

    def _expire(self, now: float) -> None:
        for peer in guard.past_deadline(self.peers.values(), lambda p: p.deadline, now):
            what = "reply not read" if peer.outbox else "no request"
            self.throttle.warning(
                "hostpool.share_timeout", peer.uid, pid=peer.pid, uid=peer.uid, reason=what
            )
            self.drop(peer)

    def drop(self, peer: Peer) -> None:
        """Close a peer's connection and everything it was owed; idempotent."""
        if self.peers.get(peer.id) is not peer:
            return
        del self.peers[peer.id]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(peer.sock)
        while peer.outbox:
            protocol.close_all(peer.outbox.popleft()[1])
        peer.sock.close()
        self.on_close(peer)
