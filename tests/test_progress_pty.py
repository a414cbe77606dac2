"""The populate bar on a real terminal (a pty) with log lines between its chunks: each log
line starts at column 0 on a line of its own (the bar was cleared first), and the bar is
redrawn after it; no log text is glued to a fragment of the bar."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_serve_progress import screen, serve_on_a_pty

ROOT = Path(__file__).resolve().parents[1]
# Eight 64 MiB chunks: at debug, each chunk's hostpool.populate and hostpool.alloc lines
# are written while the bar is shown.
CONFIG = '[pools.kv]\nsize = "512MiB"\nchunk = "64MiB"\n'
BAR = re.compile(r" +kv \[[#.]+\] \S+/512MiB \S+/s ETA \S+")
COLOURS = re.compile(r"\x1b\[[0-9;]*m")
LOG_START = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[")
CLEAR = "\r\x1b[K"


def test_log_lines_between_chunks_clear_and_redraw_the_bar(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    text = COLOURS.sub("", serve_on_a_pty(config, "--log-level", "debug"))
    starts = [m.start() for m in LOG_START.finditer(text)]
    assert starts, text[-2000:]
    first_bar = BAR.search(text)
    assert first_bar is not None, text[-2000:]
    cleared = 0
    for start in starts:
        # A log line starts at column 0: after a newline, or after the bar was cleared.
        before = text[:start]
        assert start == 0 or before.endswith("\n") or before.endswith(CLEAR), repr(
            text[max(0, start - 120) : start + 80]
        )
        if start > first_bar.start() and before.endswith(CLEAR):
            # It cleared the bar: the bar comes back right after its line.
            end = text.index("\n", start) + 1
            assert text.startswith(CLEAR, end), repr(text[start : end + 120])
            assert BAR.match(text, end + len(CLEAR)), repr(text[end : end + 120])
            cleared += 1
    # Several chunks' lines were written while the bar was shown.
    assert cleared >= 8, cleared
    lines = screen(text)
    for line in lines:
        if "hostpool." in line:
            assert LOG_START.match(line), repr(line)  # column 0, a line of its own
            assert "ETA" not in line and "[#" not in line and "[." not in line, repr(line)
    bars = [x for x in lines if BAR.search(x)]
    assert bars and "512MiB/512MiB" in bars[-1], bars
