"""The exporter as two processes: one reads the host, the other answers the network.

`hostpool exporter` creates a socketpair, then forks (`split`):

- the **listener** (the parent: the process that was started, and that a SIGTERM
  reaches) drops to an unprivileged user with no capability (`base.sandbox`), then
  serves HTTP, TLS and basic auth. It never reads /proc: `/metrics` answers with the
  text the reader last rendered (`ReadingLink`), asking for a new one only when that
  one is older than the minimum scan interval, one question at a time;
- the **reader** (the child) keeps CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH and nothing
  else, loads the read-only seccomp filter (`base.readonly`) before its first scan, and
  dies with the listener (PR_SET_PDEATHSIG: the kernel kills it, even stuck in a stalled
  filesystem, even of another uid). Its only input is one byte per question on the
  socketpair (`answer_questions`); anything else ends it. It renders the registry's
  metrics (the text format) and sends them back, framed by their length.

The minimum interval is kept on both sides: a flood of scrapes is answered from the
listener's copy (no question asked), and a listener that asks too often (a compromised
one) gets the reader's copy, so at most one scan runs at a time and at most one starts
per interval. `hostpool_exporter_scans_total`, rendered into every answer, tells which
scan an answer carries.

Health (`ReadingLink.health`): unhealthy when a question has waited `stall_after`
seconds without an answer (a scan that never finishes: a stalled filesystem, a stopped
reader), or when the reader is gone (then the listener stops too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from hostpool.base import events, sandbox
from hostpool.errors import UnavailableError
from hostpool.net.routes import send
from hostpool.net.wsgi import WSGIApp

ASK = b"?"
READY = b"!"  # the reader's first byte: sandboxed, about to answer
READY_WITHIN = 30.0  # seconds the listener waits for it
_LENGTH = struct.Struct(">Q")
MAX_ANSWER = 256 << 20  # bytes: the listener refuses a larger answer (and stops)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes
_TEXT = "text/plain; charset=utf-8"


class ScanCount(Collector):
    """`hostpool_exporter_scans_total`: the scans this reader ran, this one included."""

    def __init__(self) -> None:
        self.scans = 0

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "hostpool_exporter_scans_total",
            "Scans of the host this exporter ran; every /metrics answer carries the count "
            "of the scan it shows (answers within --min-scan-interval share one).",
        )
        family.add_metric([], self.scans)
        yield family


def answer_questions(
    sock: socket.socket,
    render: Callable[[], bytes],
    *,
    min_interval: float,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """The reader's loop: for each ASK byte, `render()`'s text (a fresh one unless the
    last is younger than `min_interval`), framed by its length; an empty answer when
    `render()` raised (logged: `hostpool.exporter_scan_failed`; the reader goes on).
    Returns when the listener closes its end or sends anything but ASK."""
    last: bytes | None = None
    finished = 0.0
    while True:
        try:
            question = sock.recv(1)
        except OSError:
            return
        if question != ASK:
            return  # closed, or not a question this loop knows: end, take nothing else
        if last is None or clock() - finished >= min_interval:
            try:
                last = render()
            except Exception as exc:  # one scan's failure, not the reader's end
                events.error("hostpool.exporter_scan_failed", error=f"{type(exc).__name__}: {exc}")
                last = None
            finished = clock()
        try:
            sock.sendall(_LENGTH.pack(len(last or b"")) + (last or b""))
        except OSError:
            return


class ReadingLink:
    """The listener's end: the reader's last answer, shared by every scrape for
    `min_interval` seconds; a scrape waits at most `answer_within` for a new one."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        min_interval: float,
        answer_within: float,
        stall_after: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sock = sock
        self.min_interval = min_interval
        self.answer_within = answer_within
        self.stall_after = stall_after
        self._clock = clock
        self._cond = threading.Condition()
        self._latest: bytes | None = None
        self._latest_at = 0.0
        self._answers = 0
        self._asked_at: float | None = None  # the question waiting for its answer
        self.gone: str | None = None  # why the reader is gone

    def start(self, on_gone: Callable[[str], None]) -> None:
        """Receive answers in a thread; `on_gone(why)` once the reader is gone."""
        threading.Thread(
            target=self._receive, args=(on_gone,), name="hostpool-reader-link", daemon=True
        ).start()

    def reading(self) -> bytes | None:
        """The metrics text to serve: the last answer while it is fresh, else the next
        one; None when none came within `answer_within` (or the reader is gone)."""
        with self._cond:
            now = self._clock()
            if self._latest is not None and now - self._latest_at < self.min_interval:
                return self._latest
            if self.gone is not None:
                return None
            if self._asked_at is None:
                try:
                    self._sock.sendall(ASK)
                except OSError as exc:
                    self._lost(f"cannot ask the reader: {exc.strerror}")
                    return None
                self._asked_at = now
            wanted = self._answers + 1
            self._cond.wait_for(
                lambda: self._answers >= wanted or self.gone is not None,
                timeout=self.answer_within,
            )
            return self._latest if self._answers >= wanted else None

    def health(self) -> str | None:
        """None while scans finish; else why not, in a few words."""
        with self._cond:
            if self.gone is not None:
                return f"the reader is gone: {self.gone}"
            if self._asked_at is None:
                return None
            waited = self._clock() - self._asked_at
        if waited <= self.stall_after:
            return None
        return (
            f"no scan finished for {waited:.0f} s while scrapes asked for one (more than "
            f"{self.stall_after:g} s): the reader is stuck"
        )

    def close(self) -> None:
        """Close this end: the reader's loop sees it closed (a shutdown first: a close
        alone leaves the receiving thread's recv holding the socket open)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _lost(self, why: str) -> None:
        with self._cond:
            if self.gone is None:
                self.gone = why
            self._cond.notify_all()

    def _receive(self, on_gone: Callable[[str], None]) -> None:
        try:
            while True:
                head = self._exactly(_LENGTH.size)
                (length,) = _LENGTH.unpack(head)
                if length > MAX_ANSWER:
                    raise ValueError(f"an answer of {length} bytes (at most {MAX_ANSWER})")
                body = self._exactly(length)
                with self._cond:  # an empty answer: that scan failed (None: a 503)
                    self._latest, self._latest_at = body or None, self._clock()
                    self._answers += 1
                    self._asked_at = None
                    self._cond.notify_all()
        except (OSError, EOFError, ValueError) as exc:
            self._lost(str(exc) or type(exc).__name__)
        on_gone(self.gone or "?")

    def _exactly(self, n: int) -> bytes:
        chunks: list[bytes] = []
        while n:
            chunk = self._sock.recv(min(n, 1 << 20))
            if not chunk:
                raise EOFError("it closed its end (it exited)")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)


def metrics_app(link: ReadingLink) -> WSGIApp:
    """/metrics: the reading, or a 503 when none came in time."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = link.reading()
        if body is None:
            why = link.health() or (
                f"no scan finished within {link.answer_within:g} s, or it failed (the "
                "exporter's log says why)"
            )
            return send(start_response, "503 Service Unavailable", f"{why}\n".encode(), _TEXT)
        return send(start_response, "200 OK", body, CONTENT_TYPE)

    return app


def health_app(link: ReadingLink) -> WSGIApp:
    """/healthz: 200 `ok` while scans finish, else 503 saying why."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        why = link.health()
        if why is None:
            return send(start_response, "200 OK", b"ok\n", _TEXT)
        return send(
            start_response, "503 Service Unavailable", f"unhealthy: {why}\n".encode(), _TEXT
        )

    return app


def split(
    prepare: Callable[[], None],
    reader: Callable[[socket.socket], None],
    *,
    ready_within: float = READY_WITHIN,
) -> tuple[socket.socket, int]:
    """Fork: the child runs `prepare()` (its sandbox), says it is ready, then runs
    `reader(its end)` and exits with it (never returns here); the parent gets its end
    and the child's pid once the child is ready. UnavailableError when it is not within
    `ready_within` seconds (its own log line says why). Call before any thread starts."""
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the reader
        status = 1
        try:
            parent_end.close()
            # a SIGTERM to the reader ends it at once; a terminal's ^C (both get it) is
            # the listener's to handle: it ends the reader
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            sandbox.die_with_parent(parent)
            prepare()
            child_end.sendall(READY)
            reader(child_end)
            status = 0
        except BaseException as exc:  # the reader's end: said in one line, then _exit
            events.error("hostpool.exporter_reader_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            os._exit(status)
    child_end.close()
    parent_end.settimeout(ready_within)
    try:
        ready = parent_end.recv(1)
    except OSError:
        ready = b""
    if ready != READY:
        parent_end.close()
        end_reader(pid)
        raise UnavailableError(
            "its reader did not start (hostpool.exporter_reader_failed says why)"
        )
    parent_end.settimeout(None)
    return parent_end, pid


def end_reader(pid: int) -> None:
    """The reader ends with this process: killed here (its saved uid is the listener's,
    `sandbox.answerable_to`), and by the kernel if this process dies first
    (PR_SET_PDEATHSIG); reaped if it ended within a moment, never waited for longer (it
    may be stuck in a filesystem)."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.01)
