"""serve's stop wait sees a stop signal the kernel gave another thread. A SIGTERM sent
while the main thread holds it blocked (`announce` logging `hostpool.serving`) goes to a
thread that does not block it; its handler then waits for the main thread to run Python,
and a wait without end never does (the test before the fix hung here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import os, signal, threading, time
from hostpool.cli.serve import _Stop
from tests.waiting import wait_for
stop = _Stop()
def main_thread_asleep():
    with open(f"/proc/self/task/{os.getpid()}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"
def other():
    wait_for(main_thread_asleep, "the main thread in its wait")
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # taken by this thread
    time.sleep(3600)
threading.Thread(target=other, daemon=True).start()
stop.wait()
print("stopped", flush=True)
"""


def test_a_stop_taken_by_another_thread_ends_the_wait() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr
