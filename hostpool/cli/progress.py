"""Populate progress for `hostpool serve`.

On a TTY: one status line (pool, bar, bytes, rate, ETA) redrawn as each span of a chunk
is populated; log lines clear it, print, and redraw it (see logsetup), so they never
tear it. Elsewhere: a `hostpool.populate_progress` event per quarter of each pool, with the
rate so far over every pool (`rate_bytes_per_s`) and the time left for every pool
(`eta_s`, None until a rate is known).
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from hostpool.base import events
from hostpool.base.units import format_size
from hostpool.cli import logsetup

_WIDTH = 24


class PopulateProgress:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total = total
        self.lock = threading.RLock()
        self._pool = ""
        self._pool_total = 0
        self._base = 0  # bytes of the pool's finished chunks
        self._chunk = 0  # bytes of the chunk in progress populated so far
        self._all = 0  # bytes of every pool finished before this one
        self._started: float | None = None  # the first call: setup is not populate time
        self._quarters: dict[str, int] = {}
        self._shown = False

    def __enter__(self) -> PopulateProgress:
        if self.tty:
            logsetup.set_status_line(self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.tty:
            logsetup.set_status_line(None)
            with self.lock:
                if self._shown:
                    self.stream.write("\n")
                    self.stream.flush()

    def __call__(self, pool: str, done: int, total: int) -> None:
        """A chunk of `pool` finished (or the pool starts, done=0)."""
        with self.lock:
            if self._started is None:
                self._started = time.monotonic()
            if pool != self._pool:
                self._all += self._pool_total
                self._pool, self._pool_total = pool, total
            self._base, self._chunk = done, 0
            self._draw()
            rate, eta = self.rate_and_eta()
        if not self.tty and total:
            quarter = 4 * done // total
            if quarter > self._quarters.get(pool, 0):
                self._quarters[pool] = quarter
                events.info(
                    "hostpool.populate_progress",
                    pool=pool,
                    done=done,
                    total=total,
                    rate_bytes_per_s=int(rate),
                    eta_s=None if eta is None else round(eta, 1),
                )

    def populated(self, nbytes: int) -> None:
        """`nbytes` more of the chunk in progress are resident (from populate's threads)."""
        if not self.tty:
            return
        with self.lock:
            self._chunk += nbytes
            self._draw()

    def rate_and_eta(self) -> tuple[float, float | None]:
        """(bytes per second populated so far over every pool, seconds left for every
        pool at that rate: None while the rate is 0). Call under `lock`."""
        done = min(self._pool_total, self._base + self._chunk)
        started = self._started if self._started is not None else time.monotonic()
        seconds = max(1e-6, time.monotonic() - started)
        rate = (self._all + done) / seconds
        left = max(0, self.total - self._all - done)
        return rate, (left / rate if rate > 0 else None)

    def line(self) -> str:
        """The status line: pool, bar, bytes, rate and ETA. Call under `lock`."""
        done = min(self._pool_total, self._base + self._chunk)
        rate, left = self.rate_and_eta()
        eta = "?" if left is None else f"{left:.1f}s"
        filled = _WIDTH * done // self._pool_total if self._pool_total else _WIDTH
        return (
            f"{self._pool:>10} [{'#' * filled}{'.' * (_WIDTH - filled)}] "
            f"{format_size(done)}/{format_size(self._pool_total)} "
            f"{format_size(int(rate))}/s ETA {eta}"
        )

    def _draw(self) -> None:
        if not self.tty:
            return
        self.stream.write("\r\x1b[K" + self.line())
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        """Called by the log handler, under `lock`, before it writes a line."""
        if self._shown:
            self.stream.write("\r\x1b[K")

    def redraw(self) -> None:
        """Called by the log handler, under `lock`, after it wrote a line."""
        if self._shown:
            self._draw()
