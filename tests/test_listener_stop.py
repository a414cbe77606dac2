"""How the HTTP listener stops while a request is in service: with drain the answer still
goes out; without it stop() does not wait; either way a worker that ends after the stop
touches nothing the listener closed (its wake-up pipe's fd numbers may name other files
by then)."""

from __future__ import annotations

import contextlib
import errno
import http.client as http_client
import logging
import os
import socket
import stat
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from hostpool.net.listener import Listener, bind
from tests import waiting


@dataclass
class SlowApp:
    """A WSGI app that holds each request until `release` is set."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    workers: list[threading.Thread] = field(default_factory=list)
    body: bytes = b"late\n"

    def __call__(self, environ: object, start_response: Any) -> list[bytes]:
        self.workers.append(threading.current_thread())
        self.entered.set()
        self.release.wait(waiting.DEADLINE)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [self.body]

    def finish(self) -> None:
        """Let the held requests answer, and wait until their worker threads have ended."""
        self.release.set()
        for worker in self.workers:
            worker.join(waiting.DEADLINE)
            assert not worker.is_alive()


@dataclass
class Client:
    """One GET on its own thread: what it got back, or the error it ended with."""

    url: str
    answer: tuple[int, bytes] | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> Client:
        self.thread = threading.Thread(target=self._get, daemon=True)
        self.thread.start()
        return self

    def _get(self) -> None:
        try:
            with urllib.request.urlopen(self.url, timeout=waiting.DEADLINE) as r:
                self.answer = (r.status, r.read())
        except (OSError, http_client.HTTPException) as exc:
            self.error = exc

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(waiting.DEADLINE)
        assert not self.thread.is_alive()


@pytest.fixture
def waitress_errors() -> Iterator[list[logging.LogRecord]]:
    """Records waitress logs at error (its "Exception when servicing" tracebacks)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("waitress")
    handler = Keep(logging.ERROR)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _pipe_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISFIFO(os.stat(f"/proc/self/fd/{name}").st_mode):
                fds.add(int(name))
    return fds


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED


def test_a_stop_without_drain_does_not_wait_for_a_request_in_flight() -> None:
    """What kept `exporter --match` from exiting: its stop waited for the scrape in flight
    (a /proc scan, up to the scrape budget). The exporter stops with drain=False."""
    app = SlowApp()
    http = Listener(bind("127.0.0.1", 0)).serve(app)
    client = Client(http.url("/")).start()
    try:
        assert app.entered.wait(waiting.DEADLINE)
        http.stop(drain=False)
        assert not app.release.is_set()  # stop returned while the request still runs
    finally:
        app.finish()
        client.join()


def test_a_worker_waking_the_loop_as_it_stops_writes_into_no_reused_fd(
    monkeypatch: pytest.MonkeyPatch, waitress_errors: list[logging.LogRecord]
) -> None:
    """waitress's worker wakes the event loop through a pipe once it has answered, if its
    connection is still open. A stop that closes the pipe between that check and the
    write frees the pipe's fd numbers: the write must not land in whatever file took
    them (here, pipes of ours; in `serve`, any file), nor fail with EBADF."""
    from waitress import task, trigger

    pulling, proceed, workers_stopped = threading.Event(), threading.Event(), threading.Event()
    original_pull = trigger.trigger._physical_pull
    original_count = task.ThreadedTaskDispatcher.set_thread_count

    def held_pull(self: Any) -> None:
        if threading.current_thread().name.startswith("waitress-") and not pulling.is_set():
            pulling.set()  # a worker, past its connection check
            proceed.wait(waiting.DEADLINE)
        original_pull(self)

    def counted(self: Any, count: int) -> None:
        original_count(self, count)
        if count == 0:  # the stop has told the workers to end: it closes the pipe next
            workers_stopped.set()

    monkeypatch.setattr(trigger.trigger, "_physical_pull", held_pull)
    monkeypatch.setattr(task.ThreadedTaskDispatcher, "set_thread_count", counted)
    app = SlowApp()
    before = _pipe_fds()
    http = Listener(bind("127.0.0.1", 0)).serve(app)
    wake_pipe = _pipe_fds() - before  # both ends, and the loop's dup of the read end
    assert len(wake_pipe) == 3
    client = Client(http.url("/")).start()
    stopping = threading.Thread(target=http.stop, kwargs={"drain": False}, daemon=True)
    taken: list[tuple[int, int]] = []
    try:
        assert app.entered.wait(waiting.DEADLINE)
        app.release.set()
        assert pulling.wait(waiting.DEADLINE)
        stopping.start()
        # The stop has told the workers to end. A stop that closes the pipe under a
        # pending write has closed it already; one that waits for the write cannot.
        assert workers_stopped.wait(waiting.DEADLINE)
        while not wake_pipe <= _pipe_fds() and len(taken) < 64:
            taken.append(os.pipe())  # the freed numbers, as the next open() would take them
        proceed.set()
        app.finish()
        stopping.join(waiting.DEADLINE)
        assert not stopping.is_alive()
        for r, _ in taken:
            os.set_blocking(r, False)
            with pytest.raises(BlockingIOError):
                os.read(r, 1)  # nothing was written into a pipe the listener does not own
        assert [r.getMessage() for r in waitress_errors] == []
    finally:
        proceed.set()
        app.finish()
        client.join()
        for pair in taken:
            for fd in pair:
                os.close(fd)


def test_a_drained_stop_delivers_the_answer_in_service(
    waitress_errors: list[logging.LogRecord],
) -> None:
    app = SlowApp(body=b"late\n" * (8 << 20))  # beyond what the worker sends itself
    http = Listener(bind("127.0.0.1", 0)).serve(app)
    port = http.address[1]
    client = Client(http.url("/")).start()
    stopping = threading.Thread(target=http.stop, daemon=True)
    try:
        assert app.entered.wait(waiting.DEADLINE)
        stopping.start()
        waiting.wait_for(lambda: _refused(port), "the listening socket closed")
        app.finish()  # answers while the listener is stopping
        stopping.join(waiting.DEADLINE)
        assert not stopping.is_alive()
        client.join()
        assert client.error is None and client.answer == (200, app.body)
        assert [r.getMessage() for r in waitress_errors] == []
    finally:
        app.finish()
        client.join()
