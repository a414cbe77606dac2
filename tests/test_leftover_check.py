"""The end-of-run check of tests/conftest.py (issue 36, point 9): a run that leaves a file
in /tmp fails (with HOSTPOOL_LEFTOVER_CHECK=1, as `make test` runs) and names it. The run
checked is a real pytest subprocess with the conftest loaded as a plugin."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from tests import waiting

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import os

def test_leaves_a_file() -> None:
    open(os.environ["PROBE_PATH"], "w").close()
"""


def test_a_run_that_leaves_a_file_in_tmp_fails_and_names_it(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    left = Path("/tmp") / f"hostpool-leftover-probe-{secrets.token_hex(4)}"
    env = {
        **os.environ,
        "PROBE_PATH": str(left),
        "PYTHONPATH": str(ROOT),
        "HOSTPOOL_LEFTOVER_CHECK": "1",  # as `make test` runs
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-p", "tests.conftest", "--rootdir", str(tmp_path), str(probe)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=waiting.DEADLINE,
            check=False,
        )  # fmt: skip
    finally:
        left.unlink(missing_ok=True)
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1, done.stdout
    assert "left behind by this run" in done.stdout and str(left) in done.stdout, done.stdout
