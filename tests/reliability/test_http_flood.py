"""Slowloris against the HTTP listener of `serve` and `exporter` (issue 17, point 6).

The server runs as a real `hostpool` process under `ulimit -n 1024` (RLIMIT_NOFILE set in
the child). This process holds 1,020 half-open requests against it (request line and one
header, never the blank line), reopening any the server closes, and scrapes meanwhile:
every scrape answers (well within Prometheus' 10 s scrape timeout; how fast is the
docs/testing.md's figure, not this test's), nothing is logged as a traceback, and a half-open
request that is closed never runs the application (no scrape for it). Every step waits
for what it needs (the server's log, its sockets in /proc), never for a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import select
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests import waiting
from tests.reliability.results import record

ROOT = Path(__file__).resolve().parents[2]
NOFILE = 1024
HALF_OPEN = 1020
SCRAPES = 20
PARTIAL = b"GET /metrics HTTP/1.1\r\nHost: flood\r\n"  # no blank line: never complete

COMMANDS = {
    "serve": ["serve", "--port", "0", "--pool", "kv=2MiB"],
    "exporter": ["exporter", "--match", "hostpool.", "--port", "0"],
}


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@contextmanager
def _server(tmp: Path, command: str) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    err = tmp / f"{command}.err"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hostpool", "--log-level", "debug", "--log-format", "json"]
            + COMMANDS[command],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=f,
            preexec_fn=_limit_fds,
        )
    try:
        text = waiting.wait_for_log(str(err), '/metrics"', alive=proc)
        match = re.search(r'"url": "(http://[^"]+)/metrics"', text)
        assert match is not None, text
        yield proc, match.group(1), err
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Flood:
    """Holds `count` half-open requests, reopening each one the server closes."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self.address = address
        self.count = count
        self.selector = selectors.DefaultSelector()
        self.reopened = 0
        self.held: list[int] = []

    def _open(self) -> None:
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(self.address)
            s.sendall(PARTIAL)
        except OSError:
            s.close()
            return
        s.setblocking(False)
        self.selector.register(s, selectors.EVENT_READ)

    def run(self, stop: threading.Event) -> None:
        for _ in range(self.count):
            self._open()
        print("ready", flush=True)
        while not stop.is_set():
            self.held.append(len(self.selector.get_map()))
            for key, _ in self.selector.select(timeout=0.1):
                self.selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                self.reopened += 1
            while len(self.selector.get_map()) < self.count and not stop.is_set():
                self._open()


def flood_main(host: str, port: int) -> None:
    """The attacker, in its own process: holds the flood until its stdin closes."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
    flood = Flood((host, port), HALF_OPEN)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True)
    thread.start()
    flood.run(stop)
    held = sorted(flood.held)
    print(json.dumps({"reopened": flood.reopened, "held_median": held[len(held) // 2]}))


@contextmanager
def _flood(url: str) -> Iterator[dict[str, Any]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tests.reliability.test_http_flood import flood_main; "
            "flood_main(sys.argv[1], int(sys.argv[2]))",
            host,
            port,
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stats: dict[str, Any] = {}
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield stats
    finally:
        proc.stdin.close()
        out = proc.stdout.read()
        proc.wait(timeout=30)
        stats.update(json.loads(out))


def _sockets(pid: int) -> int:
    """Sockets the process holds now (its listener's and its connections)."""
    fd_dir = f"/proc/{pid}/fd"
    count = 0
    for entry in os.listdir(fd_dir):
        try:
            count += os.readlink(f"{fd_dir}/{entry}").startswith("socket:")
        except FileNotFoundError:
            continue  # closed since the listing
    return count


def _scrape(url: str) -> float:
    started = time.monotonic()
    with urllib.request.urlopen(url + "/metrics", timeout=waiting.DEADLINE) as r:
        assert r.status == 200 and r.read()
    return time.monotonic() - started


def _requests_run(log: str) -> int:
    return sum(
        1 for line in log.splitlines() if '"hostpool.http_request"' in line and '"/metrics"' in line
    )


@pytest.mark.root
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_half_open_flood_under_ulimit_1024(tmp_path: Path, command: str) -> None:
    with _server(tmp_path, command) as (proc, url, err):
        idle = _sockets(proc.pid)
        with _flood(url) as flood:
            # the server reached its cap and closes the oldest: the flood is at full force
            waiting.wait_for_log(str(err), "hostpool.http_connections_closed", alive=proc)
            latencies = [_scrape(url) for _ in range(SCRAPES)]
        # the flood is gone (its process exited): once the server has closed every one
        # of its connections, any of them that ran the application has logged it
        waiting.wait_for(lambda: _sockets(proc.pid) <= idle, "the flood's sockets closed")
        ran = _requests_run(err.read_text())
        assert proc.poll() is None, err.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    log = err.read_text()
    assert len(latencies) == SCRAPES  # each answered 200 with a body, the flood held
    assert flood["held_median"] >= HALF_OPEN - 64, flood
    # Only the scrapes ran: not one of the thousands of closed half-open requests.
    assert ran == SCRAPES, ran
    assert "Traceback" not in log and "exc_info" not in log and "exception" not in log
    assert "hostpool.http_connections_closed" in log, "the server never closed a flood connection"
    record(
        "http-flood",
        "servers",
        command,
        half_open_held=HALF_OPEN,
        half_open_held_median=flood["held_median"],
        nofile=NOFILE,
        scrapes=SCRAPES,
        scrape_max_s=round(max(latencies), 3),
        scrape_median_s=round(statistics.median(latencies), 3),
        flood_reconnects=flood["reopened"],
        application_runs_for_half_open=ran - SCRAPES,
        tracebacks=0,
    )


def test_a_lone_half_open_request_meets_its_deadline(tmp_path: Path) -> None:
    """No flood, no cap reached: the request deadline alone closes a trickling client."""
    from hostpool.net.listener import REQUEST_TIMEOUT

    with _server(tmp_path, "exporter") as (_proc, url, err):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=waiting.DEADLINE) as s:
            started = time.monotonic()
            s.sendall(PARTIAL)
            # a header line each second the server has not closed it: activity, so only
            # the request deadline (not an idle timeout) can end it
            while not select.select([s], [], [], 1.0)[0]:
                assert time.monotonic() - started < waiting.DEADLINE, "never closed"
                s.sendall(b"X-Trickle: 1\r\n")
            # Closed by the server, no response: a FIN, or a RST when trickle lines the
            # server never read were still in its receive buffer as it closed.
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1024) == b""
            waited = time.monotonic() - started
    assert waited >= REQUEST_TIMEOUT, waited  # not before its deadline
    assert "request_timeout" in err.read_text()
