"""A stop signal while `hostpool serve` populates (issue 18, point 1).

Ctrl-C or SIGTERM in the middle of populating a large pool stops it, releases what was
made (explicitly), exits 0 like any stop, and never announces `hostpool.serving`.
"Stops within a second" is the populate loop's check between 64 MiB spans; this test
waits for real state (the big pool's memfd gaining pages), not for time, so it holds on
a busy machine; the big pool never finishing is what shows the stop cut it short.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import waiting

ROOT = Path(__file__).resolve().parents[2]
BIG = 3 << 30  # one chunk: several hundred ms of page faults, a span every 64 MiB
CONFIG = f"""
[pools.first]
size = "1MiB"

[pools.big]
size = {BIG}
chunk = {BIG}
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_during_populate(tmp_path: Path, sig: signal.Signals) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    err = tmp_path / "serve.err"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hostpool",
                "--log-level",
                "debug",
                "serve",
                "--port",
                "0",
                "--config",
                str(config),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    big = f"hostpool.big.{proc.pid}."
    try:
        # the big pool's memfd exists and holds pages, not all: its populate is under way
        held = waiting.wait_for(
            lambda: 0 < (waiting.shm_fd_blocks(proc.pid, big) or 0) < BIG or None,
            "the big pool's populate under way",
            alive=proc,
        )
        assert held
        proc.send_signal(sig)
        code = proc.wait(timeout=waiting.DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = [json.loads(line) for line in err.read_text().splitlines() if line.startswith("{")]
    names = [e["event"] for e in log]
    assert code == 0, err.read_text()
    assert "hostpool.serving" not in names
    assert "hostpool.serve_stopping" in names and names[-1] == "hostpool.serve_stopped"
    # The big pool was stopped mid-populate: never allocated, and not a failure either.
    assert [e for e in log if e["event"] == "hostpool.alloc" and e["pool"] == "big"] == []
    assert "hostpool.alloc_failed" not in names and "hostpool.serve_failed" not in names
    releases = [(e["pool"], e["how"]) for e in log if e["event"] == "hostpool.release"]
    assert releases == [("first", "explicit")]
    # the 3 GiB went with the process: nothing anywhere holds or maps its memfds
    assert waiting.shm_holders(f"hostpool.big.{proc.pid}.") == []
    assert waiting.shm_holders(f"hostpool.first.{proc.pid}.") == []
