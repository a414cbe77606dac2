"""serve's stop wait sees a stop signal the kernel gave another thread. A SIGTERM sent
while the main thread holds it blocked (`announce` logging `hostpool.serving`) goes to a
thread that does not block it; its handler then waits for the main thread to run Python,
and a wait without end never does (the test before the fix hung here)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import signal, threading, time
from hostpool.cli.serve import _Stop
stop = _Stop()
waiting = threading.Event()
def other():
    waiting.wait()
    time.sleep(0.3)  # the main thread is in its wait by now (or soon: either way)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # taken by this thread
    time.sleep(3600)
threading.Thread(target=other, daemon=True).start()
waiting.set()
stop.wait()
print("stopped", flush=True)
"""


def test_a_stop_taken_by_another_thread_ends_the_wait() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr
