"""The connections of hostpool's HTTP listener (hostpool.net.listener): plain and TLS.

`Channel` is waitress's HTTPChannel remembering when the request now arriving started
(for the listener's request deadline), and telling the application whether its client
has gone (`environ["hostpool.client_gone"]`, a callable: the peer closed or reset the
connection, seen by poll() without reading, so it works while waitress does not read).

`TLSChannel` runs TLS over an `ssl.SSLSocket` wrapped with `do_handshake_on_connect=False`:
the handshake proceeds on the event loop as the socket becomes readable or writable
(SSLWantRead/SSLWantWrite), never blocking it; until it is done the connection counts as
a request arriving, so the request deadline closes a client that stalls in it. Reads take
a whole TLS record at a time and drain what OpenSSL holds decrypted; a send that OpenSSL
cannot finish returns 0 and is retried from waitress's buffer. Every call into the TLS
object holds the connection's lock: waitress's worker threads send as well as its loop.
"""

from __future__ import annotations

import select
import ssl
import threading
import time
from typing import Any, cast

from waitress.channel import HTTPChannel
from waitress.task import WSGITask

_TLS_RECORD = 16384  # a TLS record's most plaintext: one recv() takes a whole record


_GONE = select.POLLRDHUP | select.POLLHUP | select.POLLERR


class _Task(WSGITask):
    """waitress's WSGI task, with `hostpool.client_gone` in the environ."""

    def get_environment(self) -> dict[str, Any]:
        environ: dict[str, Any] = super().get_environment()
        environ["hostpool.client_gone"] = cast(Channel, self.channel).client_gone
        return environ


class Channel(HTTPChannel):
    """Remembers when the request now arriving started, for the request deadline."""

    task_class = _Task
    request_started: float | None = None
    handshaking = False  # a TLS handshake not done yet

    def client_gone(self) -> bool:
        """Whether the peer has closed or reset the connection, so no answer will be
        read (a client that only shut down its sending side counts as gone)."""
        sock = self.socket
        if sock is None or not self.connected:
            return True
        try:
            fd = sock.fileno()
        except OSError:
            return True
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, _GONE)
        return bool(poller.poll(0))

    def received(self, data: bytes) -> bool:
        if self.request is None and data:
            self.request_started = time.monotonic()
        done: bool = super().received(data)
        if self.request is None:
            self.request_started = None
        return done


class TLSChannel(Channel):
    """A connection wrapped in TLS: the handshake runs non-blocking on the event loop and
    counts as the start of the first request (the request deadline covers it)."""

    def __init__(self, server: Any, sock: ssl.SSLSocket, *args: Any, **kw: Any) -> None:
        self._tls_lock = threading.Lock()
        self._handshake_wants_write = False
        self._read_wants_write = False
        super().__init__(server, sock, *args, **kw)
        self.handshaking = True
        self.request_started = time.monotonic()

    def readable(self) -> bool:
        if self.handshaking:
            return not self._handshake_wants_write
        return bool(super().readable())

    def writable(self) -> bool:
        if self.handshaking:
            return self._handshake_wants_write
        return self._read_wants_write or bool(super().writable())

    def handle_read(self) -> None:
        if self.handshaking:
            self._handshake()
            return
        self._read_wants_write = False
        while True:
            sock = self.socket
            if not isinstance(sock, ssl.SSLSocket):
                return  # closed meanwhile
            try:
                with self._tls_lock:
                    data = sock.recv(_TLS_RECORD)
                    pending = sock.pending()
            except ssl.SSLWantReadError:
                return
            except ssl.SSLWantWriteError:
                self._read_wants_write = True
                return
            except OSError:  # SSLError among them: a broken record, a reset
                self.handle_close()
                return
            if not data:  # the peer closed
                self.handle_close()
                return
            self.last_activity = time.time()
            self.received(data)
            if not pending:  # else decrypted bytes wait in OpenSSL: poll() would not wake
                return

    def handle_write(self) -> None:
        if self.handshaking:
            self._handshake()
            return
        if self._read_wants_write:
            self.handle_read()
        super().handle_write()

    def send(self, data: bytes, do_close: bool = True) -> int:
        sock = self.socket
        if sock is None:
            return 0
        try:
            with self._tls_lock:
                sent: int = sock.send(data)
            return sent
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return 0  # OpenSSL wants the same bytes again: waitress retries from its buffer
        except OSError:
            if do_close:
                self.handle_close()
            return 0

    def _handshake(self) -> None:
        sock = self.socket
        assert isinstance(sock, ssl.SSLSocket)
        self._handshake_wants_write = False
        try:
            with self._tls_lock:
                sock.do_handshake()
        except ssl.SSLWantReadError:
            return
        except ssl.SSLWantWriteError:
            self._handshake_wants_write = True
            return
        except OSError:  # refused certificate, not TLS at all, a reset
            self.handle_close()
            cast(Any, self.server).limits.count("tls_handshake_failed")  # the listener's
            return
        self.handshaking = False
        self.request_started = None
        self.last_activity = time.time()
        self.handle_read()  # the request may have come with the handshake's last flight
