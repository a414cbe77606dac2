"""The end-of-run check of tests/conftest.py (issue 36, point 9; issue 41, point 6): a run
that leaves a file in /tmp or /dev/shm fails (with HOSTPOOL_LEFTOVER_CHECK=1, as `make test`
runs) and names it; what a process outside the run makes there meanwhile does not fail it.
The run checked is a real pytest subprocess with the conftest loaded as a plugin."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests import waiting

ROOT = Path(__file__).resolve().parents[1]
LEAKS = """
import os

def test_leaves_a_file() -> None:
    open(os.environ["PROBE_PATH"], "w").close()
"""
# Signals it runs (READY), then waits until the outsider has written its files (GO).
WAITS = """
import os, time

def test_waits_for_the_outsider() -> None:
    open(os.environ["READY"], "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["GO"]):
        assert time.monotonic() < deadline, "the outsider never wrote"
        time.sleep(0.01)  # a file's appearance has no event to block on here
"""


def checked_run(tmp_path: Path, probe: str, **env: str) -> subprocess.Popen[str]:
    """pytest over `probe` in a subprocess, as `make test` runs it (the check strict)."""
    path = tmp_path / "test_probe.py"
    path.write_text(probe)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.conftest", "--rootdir", str(tmp_path), str(path)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT), "HOSTPOOL_LEFTOVER_CHECK": "1"},
    )  # fmt: skip


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_a_run_that_leaves_a_file_fails_and_names_it(tmp_path: Path, where: str) -> None:
    left = Path(where) / f"hostpool-leftover-probe-{secrets.token_hex(4)}"
    try:
        run = checked_run(tmp_path, LEAKS, PROBE_PATH=str(left))
        out, _ = run.communicate(timeout=waiting.DEADLINE)
    finally:
        left.unlink(missing_ok=True)
    assert "1 passed" in out, out
    assert run.returncode == 1, out
    assert "left behind by this run" in out and str(left) in out.split("left behind")[1], out


def test_what_another_process_makes_meanwhile_does_not_fail_the_run(tmp_path: Path) -> None:
    token = secrets.token_hex(4)
    theirs = [Path("/tmp") / f"other-tool-{token}", Path("/dev/shm") / f"other-tool-{token}.shm"]
    # Named as the suite names things, but held by a process outside the run until after
    # it ends: another run's file in use.
    held = Path("/dev/shm") / f"hostpool-outsider-{token}"
    ready, go = tmp_path / "ready", tmp_path / "go"
    run = checked_run(tmp_path, WAITS, READY=str(ready), GO=str(go))
    holder = None
    try:
        waiting.wait_for(ready.exists, "the checked run's test to start", alive=run)
        # Processes outside the run's tree (this test's children, not the run's) write them.
        subprocess.run(["sh", "-c", 'for f; do echo x > "$f"; done', "sh", *map(str, theirs)],
                       check=True, timeout=60)  # fmt: skip
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'w'); print(flush=True); "
             "sys.stdin.read()", str(held)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline() == "\n"  # it holds it
        go.touch()
        out, _ = run.communicate(timeout=waiting.DEADLINE)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        if holder is not None:
            holder.communicate(timeout=60)
        for path in [*theirs, held]:
            path.unlink(missing_ok=True)
    assert "1 passed" in out, out
    assert run.returncode == 0, out
    assert "left behind by this run" not in out, out
    assert "made meanwhile by other processes" in out, out
    assert all(str(path) in out for path in [*theirs, held]), out
