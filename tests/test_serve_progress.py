"""Populate progress on a terminal (issue 18, point 10): `hostpool serve` with stderr on a
pty shows bytes, rate and ETA within one chunk, and its log lines never tear the bar."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.waiting import DEADLINE

ROOT = Path(__file__).resolve().parents[1]
# One 512 MiB chunk: populate reports each 64 MiB span of it.
CONFIG = '[pools.kv]\nsize = "512MiB"\nchunk = "1GiB"\n'
BAR = re.compile(r"kv \[[#.]+\] (\S+)/512MiB \S+/s ETA \S+")


def screen(raw: str) -> list[str]:
    """The lines a terminal shows for `raw`: \\r returns, ESC[K erases to the end."""
    raw = re.sub(r"\x1b\[[0-9;]*m", "", raw)  # colours
    lines: list[str] = []
    line: list[str] = []
    col = 0
    i = 0
    while i < len(raw):
        if raw.startswith("\x1b[K", i):
            del line[col:]
            i += 3
            continue
        ch = raw[i]
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line))
            line, col = [], 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    lines.append("".join(line))
    return lines


def serve_on_a_pty(config: Path, *flags: str) -> str:
    """Everything `hostpool serve --log-format console FLAGS` wrote to its terminal (a
    real pty) until it served, was stopped with SIGTERM and exited 0.

    The pty is read until the child closes it, also while it stops: a pty's buffer is
    small, and a child whose stop lines fill it blocks writing them, so it would never
    exit while nobody reads."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostpool", "--log-format", "console", *flags,
         "serve", "--port", "0", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=follower,
    )  # fmt: skip
    os.close(follower)
    raw = bytearray()
    try:
        deadline = time.monotonic() + DEADLINE
        closed = read_pty(leader, raw, deadline, until=b"hostpool.serving")
        assert not closed and b"hostpool.serving" in raw, (proc.poll(), raw[-2000:])
        proc.send_signal(signal.SIGTERM)
        assert read_pty(leader, raw, time.monotonic() + DEADLINE), raw[-2000:]
        assert proc.wait(timeout=DEADLINE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return raw.decode(errors="replace")


def read_pty(leader: int, into: bytearray, deadline: float, until: bytes | None = None) -> bool:
    """Append what the pty's other side writes to `into` until `until` is in it (False)
    or the other side is closed by every process that had it (True: its end of output);
    fails at `deadline`."""
    while until is None or until not in into:
        left = deadline - time.monotonic()
        assert left > 0, f"no {until!r} and no end of output: {into[-2000:]!r}"
        if not select.select([leader], [], [], min(left, 0.5))[0]:
            continue
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: no process has the other side open any more
            return True
        if not chunk:
            return True
        into += chunk
    return False


def test_progress_bar_within_a_chunk_and_untorn_by_logs(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    text = serve_on_a_pty(config)
    # Every state the bar went through, as written (before the terminal overwrote it).
    shown = {m.group(1) for m in BAR.finditer(text)}
    assert shown & {"64MiB", "128MiB", "192MiB", "256MiB", "320MiB", "384MiB", "448MiB"}, shown
    lines = screen(text)
    assert any("hostpool.pool_ready" in x for x in lines)
    assert any("hostpool.serving" in x for x in lines)
    for line in lines:
        # A log line on its own line: never glued to (or overwritten into) the bar.
        assert not (BAR.search(line) and "hostpool." in line), line
    final = [x for x in lines if BAR.search(x)]
    assert final and BAR.search(final[-1]).group(1) == "512MiB"  # type: ignore[union-attr]


def test_stop_lines_beyond_the_pty_buffer(tmp_path: Path) -> None:
    """A stop that logs more than a pty holds (a debug release line per chunk, 2,048
    chunks) still ends: the pty is read while serve stops."""
    config = tmp_path / "serve.toml"
    config.write_text('[pools.kv]\nsize = "8MiB"\nchunk = "4KiB"\n')
    text = serve_on_a_pty(config, "--log-level", "debug")
    released = [x for x in screen(text) if "hostpool.release" in x]
    assert len(released) == 2048
    assert "hostpool.serve_stopped" in text
