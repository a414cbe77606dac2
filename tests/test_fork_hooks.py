"""Fork hooks live in one module (hostpool.base.fork): it alone calls
os.register_at_fork, runs the child's hooks in floor order (fresh locks first), and one
hook that raises does not stop the others."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hostpool.core.hostbudget
import hostpool.core.ledger
import hostpool.metrics.collector
import hostpool.metrics.multiprocess  # imported for its hooks
from hostpool.base import fork

PACKAGE = Path(hostpool.core.ledger.__file__).resolve().parents[1]


def test_only_the_fork_module_registers_with_os() -> None:
    callers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "os.register_at_fork(" in path.read_text()
    )
    assert callers == ["base/fork.py"]


def test_child_hooks_run_in_floor_order() -> None:
    owners = [h.owner for h in fork.registered() if h.after_in_child is not None]
    assert owners[0] == "hostpool.base.locks"  # every lock is fresh before anyone uses one
    for later in ("hostpool.core.ledger", "hostpool.core.hostbudget"):
        assert owners.index("hostpool.base.locks") < owners.index(later)
    assert {"hostpool.metrics.collector", "hostpool.metrics.multiprocess"} <= set(owners)


CHILD = """
import os, sys
from hostpool.base import fork
from hostpool.base.locks import ForkSafeLock
ran = []
def broken():
    raise RuntimeError("broken hook")
fork.on_fork("test.broken", after_in_child=broken)
fork.on_fork("test.after", after_in_child=lambda: ran.append("after"))
lock = ForkSafeLock()
lock.acquire()  # held at fork: the child must get it fresh
pid = os.fork()
if pid == 0:
    ok = ran == ["after"] and lock.acquire(timeout=5)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_raising_hook_is_reported_and_the_others_run() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "child 0", done.stdout + done.stderr
    assert "Exception ignored in hostpool's fork hook of test.broken" in done.stderr
    assert "RuntimeError: broken hook" in done.stderr
