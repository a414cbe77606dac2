"""The host-wide budget across real processes: flock liveness, SIGKILL, fork, stale files."""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hostpool import AllocationError, HostPoolManager
from hostpool.core.budget import BudgetPolicy
from hostpool.core.hostbudget import HostBudget, check_directory
from hostpool.errors import ConfigError
from tests import waiting
from tests.helpers import public_dir

MiB = 1 << 20
LIMIT = 256 * MiB
SHARE = int(LIMIT * 0.4)
NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

# A rank: reserves through a real manager on "go", reports, then holds until killed.
RANK = textwrap.dedent(
    """
    import sys, torch
    from hostpool import AllocationError, HostPoolManager
    from hostpool.core.hostbudget import HostBudget
    manager = HostPoolManager(budget=HostBudget({limit}, {directory!r}))
    allocator = manager.allocator("kv", "shm")
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        t = allocator.allocate(({need},), torch.uint8)
        t[::4096] = 1
    except AllocationError as exc:
        print("refused", str(exc).replace("\\n", " "), flush=True)
        sys.exit(0)
    print("ok", flush=True)
    sys.stdin.readline()
    """
)


class Rank:
    def __init__(self, directory: Path, need: int = SHARE) -> None:
        code = RANK.format(limit=LIMIT, directory=str(directory), need=need)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def line(self, timeout: float = 60) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "rank did not answer in time"
        return self.proc.stdout.readline().strip()

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    started: list[Rank] = []
    yield started
    for r in started:
        r.kill()


def test_four_ranks_share_256mib_then_a_killed_holder_frees_its_share(
    tmp_path: Path, ranks: list[Rank]
) -> None:
    ranks += [Rank(tmp_path) for _ in range(4)]
    assert [r.line() for r in ranks] == ["ready"] * 4
    for r in ranks:  # all at once: they race for the directory lock
        r.say("go")
    answers = [r.line() for r in ranks]
    holders = [r for r, a in zip(ranks, answers, strict=True) if a == "ok"]
    refused = [a for a in answers if a.startswith("refused")]
    assert len(holders) == 2 and len(refused) == 2, answers
    for message in refused:
        assert "host budget refused" in message
        assert f"need {SHARE} bytes" in message
        assert "2 other process(es) on this host reserve" in message
        assert f"host budget {LIMIT} bytes (256MiB)" in message
    assert HostBudget(LIMIT, tmp_path).reserved_bytes() == 2 * SHARE

    holders[0].kill()  # SIGKILL: no cleanup runs, the file stays, its lock goes
    latecomer = Rank(tmp_path)
    ranks.append(latecomer)
    assert latecomer.line() == "ready"
    latecomer.say("go")
    assert latecomer.line() == "ok"
    assert HostBudget(LIMIT, tmp_path).reserved_bytes() == 2 * SHARE


FORKER = textwrap.dedent(
    """
    import os, sys
    from hostpool.core.hostbudget import HostBudget
    budget = HostBudget({limit}, {directory!r})
    budget.admit({need}, 0)
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:
        # the fork hook has run by now: tell the parent (never stdout: one writer there)
        os.write(ready_w, b"1")
        sys.stdin.read()  # held until the test closes our stdin (or kills us)
        os._exit(0)
    os.read(ready_r, 1)
    print(child, flush=True)  # only once the child is ready: the test may kill us then
    sys.stdin.read()
    """
)


def test_a_forked_child_does_not_keep_a_killed_parents_reservation(tmp_path: Path) -> None:
    code = FORKER.format(limit=LIMIT, directory=str(tmp_path), need=100 * MiB)
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        observer = HostBudget(LIMIT, tmp_path)
        assert observer.reserved_bytes() == 100 * MiB
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        os.kill(child, 0)  # the child lives on...
        assert observer.reserved_bytes() == 0  # ...without holding the parent's lock
        observer.admit(LIMIT, 0)  # the whole budget is free again
        assert [p.name for p in tmp_path.glob("*.resv")] == [Path(observer._state.path or "").name]
    finally:
        parent.kill()
        parent.wait()
        if child:
            os.kill(child, signal.SIGKILL)
        assert parent.stdin is not None
        parent.stdin.close()


def test_stale_reservations_are_ignored_and_removed(tmp_path: Path) -> None:
    (tmp_path / "4242.deadbeef.resv").write_text(f"{LIMIT} 4242\n")  # nobody holds its lock
    budget = HostBudget(LIMIT, tmp_path)
    budget.admit(LIMIT, 0)
    assert not (tmp_path / "4242.deadbeef.resv").exists()


def test_live_peers_in_one_process_count(tmp_path: Path) -> None:
    a, b = HostBudget(LIMIT, tmp_path), HostBudget(LIMIT, tmp_path)
    a.admit(200 * MiB, 0)
    with pytest.raises(AllocationError, match="1 other process") as exc:
        b.admit(100 * MiB, 0)
    assert exc.value.reason == "budget"
    a.settle(50 * MiB)  # a freed memory: its reservation shrinks
    b.admit(100 * MiB, 0)
    assert a.reserved_bytes() == b.reserved_bytes() == 150 * MiB
    a.close()
    assert b.reserved_bytes() == 100 * MiB
    assert len(list(tmp_path.glob("*.resv"))) == 1


def test_a_reservation_file_is_locked_while_its_budget_lives(tmp_path: Path) -> None:
    budget = HostBudget(LIMIT, tmp_path)
    budget.admit(MiB, 0)
    (path,) = tmp_path.glob("*.resv")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        del budget  # collected: the reservation goes with it
        assert not path.exists()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_manager_uses_it_as_its_budget(tmp_path: Path) -> None:
    budget = HostBudget("8MiB", tmp_path)
    assert isinstance(budget, BudgetPolicy)
    with HostPoolManager(budget=budget) as manager:
        allocator = manager.allocator("hb")
        t = allocator.allocate((6 * MiB,), torch.uint8)
        assert manager.budget_bytes == 8 * MiB
        assert manager.budget_reserved_bytes == 6 * MiB
        with pytest.raises(
            AllocationError, match=r"need 4194304 bytes \(4MiB\) with 6291456 bytes"
        ):
            allocator.allocate((4 * MiB,), torch.uint8)
        allocator.release(t)
        del t
        t = allocator.allocate((4 * MiB,), torch.uint8)  # the next admission re-reserves
        assert budget.reserved_bytes() == 4 * MiB
        del t


def test_bad_budgets() -> None:
    with pytest.raises(ValueError, match="positive"):
        HostBudget(0, "/tmp")
    with pytest.raises(ValueError):
        HostBudget("lots", "/tmp")
    blocker = Path("/proc/self/hostbudget-cannot-exist")
    with pytest.raises(ValueError, match="directory"):
        HostBudget(MiB, blocker)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_a_symlink_planted_by_another_uid_to_a_root_directory_is_refused() -> None:
    """Issue 43, point 7: uid 65534 plants `hostpool-budget` in a sticky public directory
    (as /dev/shm is) as a symlink to a directory of root's: root's budget refuses it with
    one clear error and writes nothing there (the old open followed it: root's lock and
    reservation landed in root's directory, which passes the owner check)."""
    with public_dir("hostpool-squat-") as top:
        public = os.path.join(top, "shm")
        target = os.path.join(top, "roots")
        os.mkdir(public, 0o1777)
        os.chmod(public, 0o1777)
        os.mkdir(target, 0o755)
        planted = os.path.join(public, "hostpool-budget")
        subprocess.run(
            [*AS_NOBODY, "ln", "-s", target, planted], check=True, timeout=waiting.DEADLINE
        )
        assert os.lstat(planted).st_uid == NOBODY
        with pytest.raises(ConfigError) as refused:
            HostBudget(LIMIT, planted)
        message = str(refused.value)
        assert "\n" not in message
        assert f"{planted} is a symlink (of uid {NOBODY})" in message, message
        with pytest.raises(ConfigError, match="symlink"):
            check_directory(planted)  # serve --check says the same
        assert os.listdir(target) == []  # nothing written through the link
