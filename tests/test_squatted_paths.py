"""Paths another user got to first (issue 36, point 2): the host budget's directory and
lock, the share socket's directory lock. A real other uid (`setpriv --reuid 65534`) owns
the directories and holds the flocks; `hostpool serve` runs as a real subprocess.

Nothing here hangs: what used to block forever runs in a thread joined with a deadline
or in a subprocess waited on with one, and the stranger's lock is released in `finally`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from hostpool import HostPoolManager
from hostpool.core.hostbudget import HostBudget
from hostpool.errors import AllocationError, ConfigError, UnavailableError
from hostpool.share import socketpath
from tests import waiting

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
MiB = 1 << 20

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("flock") is None,
    reason="needs root, setpriv and flock(1) to act as another uid",
)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other uids can traverse (pytest's tmp_path is root's, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="hostpool-squat-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def as_nobody(*command: str) -> None:
    subprocess.run([*AS_NOBODY, *command], check=True, timeout=waiting.DEADLINE)


@contextmanager
def nobody_holds_flock(path: Path) -> Iterator[int]:
    """uid 65534 holds an exclusive flock on `path` (a file or a directory) until the
    block ends; yields the pid that took it."""
    proc = subprocess.Popen(
        [*AS_NOBODY, "flock", "--exclusive", str(path), "-c", "echo locked; exec cat >/dev/null"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "locked\n", proc.poll()
        yield proc.pid
    finally:
        proc.stdin.close()  # cat ends, the shell exits, the lock goes
        proc.stdout.close()
        proc.wait(timeout=waiting.DEADLINE)


def finishes(fn: Callable[[], Any]) -> Any:
    """fn() in a thread joined with a deadline: a call that blocks forever fails the test
    instead of hanging the run. Returns fn's value or re-raises its exception."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(waiting.DEADLINE)
    assert not thread.is_alive(), f"{fn} did not return within {waiting.DEADLINE:.0f} s"
    if errors:
        raise errors[0]
    return out[0] if out else None


# -- the host budget's directory ---------------------------------------------------------
def test_budget_directory_of_another_uid_is_refused(open_dir: Path) -> None:
    open_dir.chmod(0o1777)
    squatted = open_dir / "hostpool-budget"
    as_nobody("mkdir", "-m", "0777", str(squatted))  # made first, by someone else
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}.*server.budget_dir"):
        HostBudget(64 * MiB, squatted)
    # serve --check finds it, and serve refuses it before allocating: one line, exit 2
    for check in (["--check"], []):
        done = subprocess.run(
            [sys.executable, "-m", "hostpool", "serve", *check, "--port", "0",
             "--pool", "kv=1MiB", "--host-budget", "64MiB", "--budget-dir", str(squatted)],
            cwd=ROOT, capture_output=True, text=True, timeout=waiting.DEADLINE, check=False,
        )  # fmt: skip
        assert done.returncode == 2, (check, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and f"uid {NOBODY}" in done.stderr, done.stderr
        assert "--budget-dir" in done.stderr, done.stderr


def test_budget_directory_writable_by_others_needs_the_sticky_bit(tmp_path: Path) -> None:
    loose = tmp_path / "budget"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match="sticky"):
        HostBudget(64 * MiB, loose)
    loose.chmod(0o1777)  # like /dev/shm itself: others cannot remove or replace our files
    budget = HostBudget(64 * MiB, loose)
    budget.admit(MiB, 0)
    assert budget.reserved_bytes() == MiB
    budget.close()


def test_strangers_files_are_neither_counted_nor_removed(open_dir: Path) -> None:
    shared = open_dir / "budget"
    shared.mkdir()
    shared.chmod(0o1777)
    # Another uid's "reservation" of far more than the limit, locked as a live one's.
    huge = shared / "1.stranger.resv"
    as_nobody("sh", "-c", f"echo '{1 << 40} 1' > {huge}")
    fifo = shared / "2.fifo.resv"  # opening it for reading without O_NONBLOCK blocks
    os.mkfifo(fifo)
    (shared / "3.link.resv").symlink_to("/etc/passwd")
    stale = shared / "4.dead.resv"  # ours, unlocked: its owner is gone
    stale.write_text(f"{32 * MiB} 4\n")
    with nobody_holds_flock(huge):
        budget = HostBudget(64 * MiB, shared)
        finishes(lambda: budget.admit(16 * MiB, 0))
        assert finishes(budget.reserved_bytes) == 16 * MiB
        budget.close()
    assert huge.exists() and fifo.exists() and (shared / "3.link.resv").is_symlink()
    assert not stale.exists()


def test_a_strangers_lock_file_is_refused_not_used(open_dir: Path) -> None:
    shared = open_dir / "budget"
    shared.mkdir()
    shared.chmod(0o1777)
    as_nobody("touch", str(shared / ".lock"))  # theirs: they could flock it for ever
    budget = HostBudget(64 * MiB, shared)
    with HostPoolManager(budget=budget) as manager:
        with pytest.raises(ConfigError, match=f"lock .* \\(uid {NOBODY}\\)"):
            finishes(lambda: manager.allocator("kv").allocate((MiB,), torch.uint8))
        assert finishes(budget.reserved_bytes) == 0  # a scrape is not refused
    budget.close()


def test_a_strangers_lock_is_waited_on_with_a_deadline(open_dir: Path) -> None:
    directory = open_dir / "budget"
    budget = HostBudget(64 * MiB, directory, lock_timeout_s=0.2)
    budget.admit(MiB, 0)  # makes the lock file
    budget.settle(0)
    directory.chmod(0o755)
    (directory / ".lock").chmod(0o644)  # another uid can open (and so flock) it
    with nobody_holds_flock(directory / ".lock") as pid:
        with pytest.raises(AllocationError, match=f"pid {pid} \\(uid {NOBODY}\\)") as info:
            finishes(lambda: budget.admit(MiB, 0))
        assert info.value.reason == "budget"
        assert ".lock" in str(info.value)
        # A scrape does not wait for it: this process's own reservation, one warning.
        with structlog.testing.capture_logs() as logs:
            assert finishes(budget.reserved_bytes) == 0
            assert finishes(budget.reserved_bytes) == 0  # told once while it stays busy
        assert [e["event"] for e in logs] == ["hostpool.host_budget_busy"]
    budget.admit(MiB, 0)  # the lock is back: admissions go on
    budget.close()


# -- the share socket's directory --------------------------------------------------------
def test_share_socket_directory_lock_of_a_stranger(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_dir.chmod(0o1777)  # like /tmp: anyone can open, and so flock, the directory
    monkeypatch.setattr(socketpath, "LOCK_TIMEOUT_S", 0.2)
    where = socketpath.SocketPath(str(open_dir / "share.sock"), open_to_others=False)
    with (
        nobody_holds_flock(open_dir) as pid,
        pytest.raises(UnavailableError, match=f"pid {pid} \\(uid {NOBODY}\\)"),
    ):
        finishes(lambda: where.listen(8))
    assert os.listdir(open_dir) == []  # nothing bound, no private bind directory left
    sock = where.listen(8)
    sock.close()
    where.release()


# -- SIGTERM ends serve whatever lock it waits on -----------------------------------------
def _serve(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hostpool", "--log-format", "json", "serve",
             "--port", "0", "--pool", "kv=1MiB", *flags],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=f,
        )  # fmt: skip
    return proc, log


def _holds_open(pid: int, path: Path) -> bool:
    try:
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return False


def _stopped_cleanly(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=waiting.DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    names = [json.loads(x)["event"] for x in text.splitlines() if x.startswith("{")]
    # Not the lock's deadline (that would be exit 1 with hostpool.serve_failed): the stop.
    assert code == 0, text
    assert "hostpool.serve_failed" not in names, text
    assert "hostpool.serve_stopping" in names and names[-1] == "hostpool.serve_stopped", text


def test_sigterm_ends_serve_waiting_for_the_budget_lock(open_dir: Path, tmp_path: Path) -> None:
    directory = open_dir / "budget"
    directory.mkdir()
    lock = directory / ".lock"
    lock.touch(mode=0o644)
    with nobody_holds_flock(lock):
        proc, log = _serve(tmp_path, "--host-budget", "64MiB", "--budget-dir", str(directory))
        try:
            waiting.wait_for(lambda: _holds_open(proc.pid, lock), "serve at the lock", alive=proc)
        finally:
            _stopped_cleanly(proc, log)


def test_sigterm_ends_serve_waiting_for_the_share_directory_lock(
    open_dir: Path, tmp_path: Path
) -> None:
    open_dir.chmod(0o1777)
    with nobody_holds_flock(open_dir):
        proc, log = _serve(tmp_path, "--share-socket", str(open_dir / "share.sock"))
        try:
            waiting.wait_for_log(str(log), "hostpool.pool_ready", alive=proc)
            waiting.wait_for(
                lambda: _holds_open(proc.pid, open_dir), "serve at the lock", alive=proc
            )
        finally:
            _stopped_cleanly(proc, log)
    assert os.listdir(open_dir) == []
