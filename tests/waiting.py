"""Waiting on events, not on time: tests pass on a busy 2-core host.

Every wait here returns as soon as what it waits for is there (a log line, a state of
/proc) and fails with what it waited for after a deadline that is only an upper bound:
generous, never a guess of how long the thing takes. The /proc readers are the tests'
own (readlink, stat, maps), independent of hostpool's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE = 120.0  # seconds: an upper bound for a busy machine, never a timing assumption
_POLL = 0.005  # between two looks at state that has no event to block on


def wait_for(
    check: Callable[[], T | None],
    what: str,
    *,
    timeout: float = DEADLINE,
    alive: object = None,
    interval: float = _POLL,
) -> T:
    """`check()` until it returns something other than None/False; that value.

    `alive`, a subprocess.Popen, fails the wait at once if it exits meanwhile; `interval`
    is the pause between two looks (a costly check looks less often)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        poll = getattr(alive, "poll", None)
        if poll is not None and poll() is not None:
            raise AssertionError(f"exited {poll()} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s")
        time.sleep(interval)


def log_text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def wait_for_log(path: str, needle: str, *, alive: object = None, timeout: float = DEADLINE) -> str:
    """The log at `path` once it contains `needle` (a process's stderr, written as it goes)."""

    def found() -> str | None:
        text = log_text(path)
        return text if needle in text else None

    return wait_for(
        found,
        f"{needle!r} in {path}",
        alive=alive,
        timeout=timeout,
    )


def shm_fd_blocks(pid: int, fragment: str) -> int | None:
    """Bytes the shm object behind `pid`'s first fd whose link contains `fragment` holds
    now (st_blocks * 512), or None when no fd of `pid` names it (yet, or any more)."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        entries = os.listdir(fd_dir)
    except FileNotFoundError:
        return None
    for entry in entries:
        try:
            if fragment in os.readlink(f"{fd_dir}/{entry}"):
                return os.stat(f"{fd_dir}/{entry}").st_blocks * 512
        except FileNotFoundError:
            continue
    return None


def shm_holders(fragment: str) -> list[int]:
    """Every process with an fd or a mapping whose name contains `fragment`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            with open(f"/proc/{name}/maps", errors="replace") as f:
                maps = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/{name}/fd/{fd}"))
            except (FileNotFoundError, ProcessLookupError):
                continue  # closed since the listing
        if fragment in maps or any(fragment in link for link in links):
            found.append(int(name))
    return found
