"""`make run` from a fresh clone: how long until /metrics answers, and what its venv holds.

Per round: `git clone` of this repository's HEAD into a temporary directory, then `make run
SERVE_ARGS="--pool kv=SIZE --port 0"` there (its own .venv: the serve install, no torch),
timed from the start of make until GET /metrics answers 200 (the URL read from serve's
`hostpool.serving` log line); then SIGTERM. The first round fills pip's cache; the later
ones start with it warm (the figure the target is about). Also the venv's size on disk
(allocated blocks, as `du` counts), its packages, and whether torch is among them.

Target: /metrics within 30 s of `make run` with a warm cache; no torch in the venv.
Writes bench/results/make_run.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO_ROOT, RESULTS_DIR, other_cpu, write_result

RESULTS = RESULTS_DIR / "make_run.json"
TARGET_S = 30.0
DEADLINE_S = 600.0  # an upper bound for a cold install on a slow network, not a figure


def disk_bytes(top: Path) -> int:
    """Bytes allocated to every file under `top` (st_blocks, as `du` counts them)."""
    total = 0
    for folder, _dirs, files in os.walk(top):
        for name in files:
            total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def one_round(size: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hostpool-make-run-") as top:
        clone = Path(top) / "hostpool"
        subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True)
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True
        ).stdout.strip()
        log = Path(top) / "make.err"
        with other_cpu() as load:
            started = time.monotonic()
            with open(log, "w") as err:
                make = subprocess.Popen(
                    ["make", "--no-print-directory", "run",
                     f"SERVE_ARGS=--pool kv={size} --port 0 --log-format json"],
                    cwd=clone, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                )  # fmt: skip
            try:
                url = wait_for_url(log, make)
                with urllib.request.urlopen(url, timeout=30) as response:
                    assert response.status == 200
                seconds = time.monotonic() - started
            finally:
                os.killpg(make.pid, signal.SIGTERM)
                make.wait(timeout=60)
        venv = clone / ".venv"
        listed = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        packages = {p["name"].lower(): p["version"] for p in json.loads(listed)}
        return {
            "commit": commit,
            "metrics_s": seconds,
            "venv_bytes": disk_bytes(venv),
            "packages": packages,
            "torch": "torch" in packages,
            "other_cpus": load["other_cpus"],
        }


def wait_for_url(log: Path, make: subprocess.Popen[bytes]) -> str:
    """The /metrics URL of serve's `hostpool.serving` line, once it is logged."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if '"hostpool.serving"' in line:
                return str(json.loads(line)["url"])
        if make.poll() is not None:
            raise SystemExit(f"make run exited {make.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.05)  # a file being written has no event to block on
    raise SystemExit(f"no hostpool.serving line in {DEADLINE_S} s: {log.read_text()[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="the first fills the cache")
    parser.add_argument("--size", default="64MiB", help="the one pool's size")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if shutil.which("make") is None or shutil.which("git") is None:
        raise SystemExit("needs make and git")
    rounds = [one_round(args.size) for _ in range(args.rounds)]
    for i, r in enumerate(rounds):
        print(f"round {i}: /metrics {r['metrics_s']:.1f} s, venv {r['venv_bytes']:,} bytes")
    write_result(
        args.output,
        bench="make_run",
        commit=rounds[0]["commit"],
        config={"rounds": args.rounds, "size": args.size},
        targets={"metrics_s": TARGET_S},
        rounds=rounds,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
