"""A stop signal while `hostpool serve` populates (issue 18, point 1).

Ctrl-C or SIGTERM in the middle of populating a large pool stops it within a second,
releases what was made (explicitly), exits 0 like any stop, and never announces
`hostpool.serving`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import helpers

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
    baseline = helpers.shmem_bytes()
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hostpool", "serve", "--port", "0", "--config", str(config)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    try:
        deadline = time.monotonic() + 60
        while '"pool": "first", "bytes"' not in err.read_text():  # pool_ready of `first`
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.005)
        time.sleep(0.05)  # into the big pool's populate
        sent = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = [json.loads(line) for line in err.read_text().splitlines() if line.startswith("{")]
    names = [e["event"] for e in log]
    assert code == 0, err.read_text()
    assert elapsed < 1.0, elapsed
    assert "hostpool.serving" not in names
    assert "hostpool.serve_stopping" in names and names[-1] == "hostpool.serve_stopped"
    # The big pool was stopped mid-populate: never allocated, and not a failure either.
    assert [e for e in log if e["event"] == "hostpool.alloc" and e["pool"] == "big"] == []
    assert "hostpool.alloc_failed" not in names and "hostpool.serve_failed" not in names
    releases = [(e["pool"], e["how"]) for e in log if e["event"] == "hostpool.release"]
    assert releases == [("first", "explicit")]
    assert helpers.shmem_bytes() < baseline + (64 << 20)  # the 3 GiB went with the process
