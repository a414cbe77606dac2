"""Issue 36.6: `serve --check` checks what serve itself would fail on, before a page is
populated, each as one line with its exit status, through the real CLI:

- a share-socket directory the serving user cannot write (a root-owned 0755 directory,
  served as uid 65534): exit 2;
- RLIMIT_NOFILE below the fds the pools' regions keep open: exit 1, also without --check;
- pools above the cgroup's free memory (a real v1 memory cgroup with most of its limit
  used by a tmpfs file charged to it): exit 1.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hostpool.cli.exitcodes import INVALID, NOT_NOW
from tests import helpers
from tests.helpers import hostpool, memory_cgroup

NOBODY = 65534
MiB = 1 << 20


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture
def root_dir(root: None) -> Iterator[str]:
    """A directory of root, mode 0755, in a directory every uid can traverse."""
    with helpers.public_dir("hostpool-check-") as top:
        yield top


def hostpool_as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI's `main(ARGS)` in a child forked from this process that became uid 65534:
    its exit status and stderr. Forked, not exec'd: uid 65534 may not reach this checkout
    (a clone under a 0700 directory, as `mktemp -d` makes) nor the interpreter's modules,
    so the child runs the command once as root first, which imports what it needs."""

    def run() -> str:
        from hostpool.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(list(args))
        return json.dumps([code, err.getvalue()])

    status, out = helpers.run_forked(run, uid=NOBODY, prepare=run, timeout=120)
    assert status == 0, out
    code, stderr = json.loads(out)
    return subprocess.CompletedProcess(["hostpool", *args], code, "", stderr)


def test_a_share_socket_directory_the_user_cannot_write(root_dir: str) -> None:
    path = os.path.join(root_dir, "share.sock")
    args = ("serve", "--check", "--pool", "kv=1MiB", "--port", "0", "--share-socket", path)
    proc = hostpool_as_nobody(*args)
    assert proc.returncode == INVALID, proc.stderr
    line = one_line(proc)
    assert f"share socket directory {root_dir}" in line and "not writable" in line
    assert "uid 65534" in line
    assert hostpool(*args).returncode == 0  # root may write there
    assert os.listdir(root_dir) == []  # nothing was created


def _nofile(limit: int) -> Callable[[], None]:
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return set_limit


@pytest.mark.parametrize("check", [True, False], ids=["check", "serve"])
def test_rlimit_nofile_below_what_the_regions_need(tmp_path: Path, check: bool) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('[pools.kv]\nsize = "128MiB"\nchunk = "1MiB"\n')  # 128 regions
    args = ["serve", "--config", str(config), "--port", "0"]
    proc = hostpool(*args, *(["--check"] if check else []), preexec=_nofile(100))
    assert proc.returncode == NOT_NOW, proc.stderr
    line = one_line(proc)
    assert "128 fds" in line and "RLIMIT_NOFILE 100" in line, line
    assert "hostpool.populate" not in proc.stderr and "serving" not in proc.stderr
    assert hostpool(*args, "--check", preexec=_nofile(400)).returncode == 0


@pytest.fixture
def full_cgroup(root: None) -> Iterator[Path]:
    """A v1 memory cgroup of 160 MiB, 100 MiB of it used by a tmpfs file charged to it."""
    ballast = Path(tempfile.mkdtemp(prefix="hostpool-check-", dir="/dev/shm")) / "ballast"
    try:
        with memory_cgroup("hostpool-check", 160 * MiB) as group:
            # dd runs in the cgroup: the file's pages are charged to it, and stay charged.
            subprocess.run(
                ["dd", "if=/dev/zero", f"of={ballast}", "bs=1M", "count=100", "status=none"],
                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
                check=True,
            )
            try:
                yield group
            finally:
                ballast.unlink(missing_ok=True)  # uncharged before the group goes
    finally:
        shutil.rmtree(ballast.parent, ignore_errors=True)


def test_pools_above_the_cgroups_free_memory(full_cgroup: Path) -> None:
    def enter() -> None:
        (full_cgroup / "cgroup.procs").write_text(str(os.getpid()))

    proc = hostpool("serve", "--check", "--pool", "kv=96MiB", "--port", "0", preexec=enter)
    assert proc.returncode == NOT_NOW, proc.stderr
    line = one_line(proc)
    assert "more than the cgroup has free" in line and "kv 96MiB" in line, line
    assert "limit 160MiB" in line
