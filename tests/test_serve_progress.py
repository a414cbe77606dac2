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
    real pty) until it served, was stopped with SIGTERM and exited 0."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostpool", "--log-format", "console", *flags,
         "serve", "--port", "0", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=follower,
    )  # fmt: skip
    os.close(follower)
    raw = b""
    try:
        deadline = time.monotonic() + DEADLINE
        while b"hostpool.serving" not in raw:
            assert time.monotonic() < deadline, raw[-2000:]
            assert proc.poll() is None, raw[-2000:]
            if select.select([leader], [], [], 0.5)[0]:
                raw += os.read(leader, 65536)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE) == 0
        while select.select([leader], [], [], 0.2)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child's side is closed
                break
            if not chunk:
                break
            raw += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return raw.decode(errors="replace")


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
