"""The HTTP listener of `hostpool serve` and `hostpool exporter`: waitress, hardened.

waitress reads every connection on one event loop and runs complete requests only on a
few worker threads, so idle or half-open connections cost an fd each and nothing else.
On top of it this module adds what a listener next to a production server needs, with
the policy of `hostpool.net.guard`:

- the socket is bound by `bind()` before anything slow happens (a port in use is the
  first thing an operator hears about, not the last);
- a connection cap below RLIMIT_NOFILE: when it is reached, or accept() fails with
  EMFILE, the oldest connection without a request in service is closed, so a flood of
  half-open connections cannot lock out a scraper (it only churns the flood);
- per-connection deadlines: a request must arrive whole within `request_timeout`
  seconds of its first byte, and a connection with nothing to do is closed after
  `idle_timeout`;
- a request that never completed never runs the application (no scrape for it), and
  socket errors are counted events, never tracebacks;
- with a web config (`hostpool.net.webconfig`), TLS and basic auth: each accepted socket
  is wrapped without a handshake, which then runs non-blocking on the event loop
  (`hostpool.net.channel.TLSChannel`): a client that never sends a ClientHello holds one
  fd and nothing else, and is closed at the request deadline (tls_handshake_timeout); a
  failed handshake is closed at once (tls_handshake_failed).
"""

from __future__ import annotations

import functools
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from waitress import wasyncore
from waitress.server import TcpWSGIServer

from hostpool.base import events
from hostpool.base.versiongate import VersionGate, distribution_version
from hostpool.errors import ConfigError, UnavailableError
from hostpool.net.basicauth import BasicAuth
from hostpool.net.channel import Channel, TLSChannel
from hostpool.net.guard import (
    FD_SHORTAGE,
    Backoff,
    Throttle,
    connection_cap,
    oldest_idle,
    past_deadline,
)
from hostpool.net.webconfig import WebConfig
from hostpool.net.wsgi import WSGIApp

# waitress's internals the guarded server reads. A gate, not a pin (`waitress<4`): an
# engine's environment may hold another release, which must still install beside hostpool.
WAITRESS = VersionGate(
    "waitress",
    (3, 0),
    (4,),
    relies_on="TcpWSGIServer's _map ({fd: channel}), active_channels, trigger, wasyncore.loop",
    fallback="none: the listener serves as read from 3.x; a changed internal fails at start",
)
DEFAULT_CONNECTION_LIMIT = 512


@functools.cache
def check_waitress() -> bool:
    """WAITRESS's verdict on the installed waitress, read once per process: at `bind`, so
    a listener that then gives up its privileges (the exporter's, forked) keeps the
    verdict instead of reading the package's metadata where it may no longer."""
    return WAITRESS.check(distribution_version("waitress"))  # one warning outside its range


REQUEST_TIMEOUT = 5.0
IDLE_TIMEOUT = 30.0
DRAIN_TIMEOUT = 5.0  # how long stop() lets the requests in service finish
_MAINTENANCE_INTERVAL = 0.25
_ACCEPT_BURST = 64  # accepts per wake-up: drains a flooded backlog quickly
_FD_SHORTAGE_PAUSE = 0.1  # seconds without accepting when no connection can be closed


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port. A host or port that is not one (a name that
    does not resolve) is a ConfigError; a refusal to bind or listen (the port in use, the
    address not assigned here, a privileged port) an UnavailableError: both name it."""
    check_waitress()
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, OverflowError, UnicodeError) as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise UnavailableError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def default_connection_limit() -> int:
    """A quarter of RLIMIT_NOFILE, between 8 and 512: the rest stays for the pools' fds."""
    return connection_cap(DEFAULT_CONNECTION_LIMIT, 8)


class _GuardedServer(TcpWSGIServer):
    """waitress's TCP server with eviction instead of refusing, and deadlines."""

    channel_class: type[Channel] = Channel

    def __init__(
        self,
        app: WSGIApp,
        sock: socket.socket,
        limits: _Limits,
        tls: ssl.SSLContext | None = None,
        **kw: Any,
    ) -> None:
        self.limits = limits
        self.tls = tls
        if tls is not None:
            self.channel_class = TLSChannel
        self._next_maintenance = 0.0
        self._accept_after = 0.0
        self._backoff = Backoff(_FD_SHORTAGE_PAUSE, _FD_SHORTAGE_PAUSE)
        self.stopping = False
        self._trigger_lock = threading.Lock()
        self._trigger_closed = False
        super().__init__(app, _sock=sock, bind_socket=False, **kw)

    @property
    def _wake_pipe(self) -> Any:
        # waitress's `trigger` (its stubs call it an int): the pipe that wakes the loop
        return self.trigger

    def pull_trigger(self) -> None:
        """Wake the event loop (worker threads call this when a response is written),
        unless the wake-up pipe is closed: waitress would write into its fd number, which
        may name another file by then."""
        with self._trigger_lock:
            if not self._trigger_closed:
                self._wake_pipe.pull_trigger()

    def wind_down(self, drain_timeout: float | None) -> None:
        """Stop accepting, let the workers end (each after the request it serves; with
        `drain_timeout`, the event loop keeps sending their answers until all are sent,
        for that long at most), then close the wake-up pipe and every connection. Called on the
        event loop's thread once it has left its loop."""
        wasyncore.dispatcher.close(self)  # the listening socket only
        workers = self.task_dispatcher
        workers.set_thread_count(0)  # queued requests are dropped, as waitress does
        if drain_timeout is not None:
            deadline = time.monotonic() + drain_timeout
            while self._answering() and time.monotonic() < deadline:
                wasyncore.loop(timeout=0.05, map=self.socket_map, use_poll=True, count=1)
        with self._trigger_lock:
            self._trigger_closed = True
            self._wake_pipe.close()
        wasyncore.close_all(self.socket_map)

    def _answering(self) -> bool:
        """Whether a worker still runs, or an answer is not all sent (a worker that has
        ended may leave the rest of its answer for the loop to send)."""
        workers = self.task_dispatcher
        with workers.lock:
            if workers.threads:
                return True
        return any(c.writable() for c in list(self._channels().values()))

    def readable(self) -> bool:
        now = time.monotonic()
        if now >= self._next_maintenance:
            self._next_maintenance = now + _MAINTENANCE_INTERVAL
            self._enforce_deadlines(now)
            self.limits.flush()
        return bool(self.accepting) and now >= self._accept_after and not self.stopping

    def _channels(self) -> dict[int, Channel]:
        # waitress keeps {fd: channel} in creation order; its stubs type it as one channel.
        channels: dict[int, Channel] = self.active_channels  # type: ignore[assignment]
        return channels

    @property
    def socket_map(self) -> dict[int, Any]:
        channels: dict[int, Any] = self._map  # type: ignore[attr-defined]
        return channels

    def handle_accept(self) -> None:
        listening = self.socket
        assert listening is not None
        for _ in range(_ACCEPT_BURST):
            if len(self._channels()) >= self.limits.connections:
                self._evict_oldest("connection_limit")
            try:
                conn, addr = listening.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in FD_SHORTAGE:
                    # Out of fds: make room, and wait a little instead of spinning.
                    if not self._evict_oldest("fd_limit"):
                        self._accept_after = time.monotonic() + self._backoff.next()
                    return
                self.limits.count("accept_error")
                return
            self._backoff.reset()
            # waitress's own accept sets TCP_NODELAY (its socket_options): without it,
            # Nagle holds a response written in pieces for the peer's delayed ACK
            try:
                self.set_socket_options(conn)
            except OSError:  # the peer is gone already
                conn.close()
                self.limits.count("accept_error")
                continue
            if self.tls is not None:
                try:
                    conn.setblocking(False)
                    # no I/O here: the handshake runs on the loop, in TLSChannel
                    conn = self.tls.wrap_socket(
                        conn, server_side=True, do_handshake_on_connect=False
                    )
                except OSError:  # the peer is gone already
                    conn.close()
                    self.limits.count("tls_handshake_failed")
                    continue
            self.channel_class(self, conn, addr, self.adj, map=self.socket_map)

    def _evict_oldest(self, why: str) -> bool:
        """Close the oldest connection with no request in service (waitress keeps them in
        creation order); False if every one has a request in service."""
        # a snapshot: worker threads close channels too
        channel = oldest_idle(list(self._channels().values()), lambda c: not c.requests)
        if channel is None:
            return False
        channel.handle_close()
        self.limits.count(why)
        return True

    def _enforce_deadlines(self, now: float) -> None:
        # waitress dates activity by the wall clock, a request's start by the monotonic one
        to_wall = time.time() - now
        limits = self.limits

        def deadline(channel: Channel) -> float | None:
            if channel.requests:
                return None  # in service: the application's time, not the client's
            if channel.request_started is not None:
                return channel.request_started + limits.request_timeout
            return channel.last_activity - to_wall + limits.idle_timeout

        for channel in past_deadline(list(self._channels().values()), deadline, now):
            if channel.handshaking:
                why = "tls_handshake_timeout"
            elif channel.request_started is None:
                why = "idle_timeout"
            else:
                why = "request_timeout"
            channel.handle_close()
            limits.count(why)

    def maintenance(self, now: float) -> None:
        pass  # replaced by _enforce_deadlines (monotonic time, request deadlines)


class _Limits:
    def __init__(self, connections: int, request_timeout: float, idle_timeout: float) -> None:
        self.connections = connections
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.closed: dict[str, int] = {}
        self._throttle = Throttle(interval=10.0)  # a flood is one line per 10 s

    def count(self, why: str) -> None:
        """Count a connection the listener closed; the totals go out, throttled."""
        self.closed[why] = self.closed.get(why, 0) + 1
        self._throttle.warning("hostpool.http_connections_closed", None, **self.closed)

    def flush(self) -> None:
        """Log the totals held back by the throttle once its interval has passed: a
        flood's last closes are told too, not only its first."""
        self._throttle.flush()


class Listener:
    """One bound socket served by waitress on its own thread; `stop()` joins it.

    `web_config`: TLS and basic auth (None: plain HTTP, no auth)."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        connection_limit: int | None = None,
        request_timeout: float = REQUEST_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        threads: int = 4,
        web_config: WebConfig | None = None,
    ) -> None:
        check_waitress()
        self.socket = sock
        self.web_config = web_config
        self.limits = _Limits(
            connection_limit or default_connection_limit(), request_timeout, idle_timeout
        )
        self.threads = threads
        self._server: _GuardedServer | None = None
        self._thread: threading.Thread | None = None
        self._map: dict[int, Any] = {}
        self._drain = True

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.socket.getsockname()[:2]
        return str(host), int(port)

    @property
    def url_host(self) -> str:
        host = self.address[0]
        return f"[{host}]" if ":" in host else host

    @property
    def scheme(self) -> str:
        """https when the listener serves TLS, else http."""
        return "http" if self.web_config is None else self.web_config.scheme

    def url(self, path: str = "/metrics") -> str:
        """The URL of `path` on this listener, e.g. https://127.0.0.1:9464/metrics."""
        return f"{self.scheme}://{self.url_host}:{self.address[1]}{path}"

    @property
    def closed_connections(self) -> dict[str, int]:
        """Connections the listener closed, by why (connection_limit, request_timeout...)."""
        return dict(self.limits.closed)

    def serve(self, app: WSGIApp) -> Listener:
        web = self.web_config
        if web is not None and web.users:
            # half the threads at most wait on a bcrypt round: the rest serve the others
            app = BasicAuth(web.users, app, checking=max(1, self.threads // 2))

        def logged(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            # Only complete requests get here: a half-open one never runs the application.
            events.debug("hostpool.http_request", path=environ.get("PATH_INFO", ""))
            return app(environ, start_response)

        self._server = _GuardedServer(
            logged,
            self.socket,
            self.limits,
            tls=None if web is None else web.tls,
            url_scheme=self.scheme,
            map=self._map,
            threads=self.threads,
            connection_limit=self.limits.connections,
            channel_timeout=int(self.limits.idle_timeout),
            log_socket_errors=False,
            asyncore_use_poll=True,  # select() stops at fd 1024
            ident="hostpool",
        )
        server = self._server

        def loop() -> None:
            while not server.stopping:
                wasyncore.loop(timeout=0.5, map=self._map, use_poll=True, count=1)
            # without drain, requests in flight end with the process (sockets closed)
            server.wind_down(DRAIN_TIMEOUT if self._drain else None)

        self._thread = threading.Thread(target=loop, name="hostpool-http", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, drain: bool = True) -> None:
        """Close the listener and every connection. `drain`: wait (a few seconds at most)
        for the requests in flight to finish; without it, a caller that exits next is
        not held by a slow one (the exporter's /proc scan: up to its scrape budget)."""
        if self._server is None or self._thread is None:
            self.socket.close()
            return
        self._drain = drain
        self._server.stopping = True
        self._server.pull_trigger()  # wakes the loop now, not at its next timeout
        self._thread.join(timeout=10)
