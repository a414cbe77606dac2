"""procfs.walk, the one way a process is read (the exporter's reader, inspect's through
it, and the host view's): a process gone between its maps and its fd directory, a step
that raises, and both readers over it on a real child."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from hostpool.proc import hostread, procfs, procgroup, scan

HOLDER = "import os, sys; fd = os.memfd_create('hostpool.walk.1.2'); print('ready', flush=True); sys.stdin.readline()"  # noqa: E501


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def child() -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_process_gone_after_its_maps_is_not_found_and_nothing_stays_open() -> None:
    proc = child()
    before = open_fds()

    def objects(data: bytes) -> bytes:
        proc.kill()  # gone between the maps read and the fd directory
        proc.wait()
        return data

    def fds(_data: bytes, _fd_dir: procfs.FdDir) -> bool:
        raise AssertionError("the fd step of a process gone")

    with pytest.raises(procfs.ProcessNotFoundError):
        procfs.walk(proc.pid, objects, fds)
    assert open_fds() == before


def test_the_steps_see_the_process_and_a_step_that_raises_closes_the_directory() -> None:
    proc = child()
    try:
        seen: dict[str, Any] = {}

        def fds(data: bytes, fd_dir: procfs.FdDir) -> bool:
            seen.update(maps=data, path=fd_dir.path, entries=fd_dir.entries)
            assert os.fstat(fd_dir.fd).st_ino == os.stat(fd_dir.path).st_ino
            return False

        pid, data, complete = procfs.walk(proc.pid, lambda d: d, fds)
        assert (pid, complete) == (proc.pid, False)
        assert b"/memfd:hostpool.walk.1.2" not in data  # held by an fd, not mapped
        assert seen["path"] == f"/proc/{proc.pid}/fd" and b"3" in seen["entries"]
        before = open_fds()

        def failing(_data: bytes, _fd_dir: procfs.FdDir) -> bool:
            raise procfs.ProcessAccessError(proc.pid, f"/proc/{proc.pid}/fd")

        with pytest.raises(procfs.ProcessAccessError):
            procfs.walk(proc.pid, lambda d: d, failing)
        assert open_fds() == before
        # the readers over it: the fd-only memfd, in each
        holdings = scan.read_holdings(proc.pid, scan.Matcher(("hostpool.walk",)))
        assert [name.name for _link, name, _n in holdings.unmapped_fds.values()] == [
            "hostpool.walk.1.2"
        ]
        (fd,) = procgroup.read_process(proc.pid, ("hostpool.walk",)).fds
        assert (fd.fd, fd.name.name) == (3, "hostpool.walk.1.2")
        read = hostread.HostReader({hostread.internal_devices().shmem}).read(proc.pid)
        assert any(
            row[scan.ROW_PATH].startswith(b"/memfd:hostpool.walk") for row in read.rows.values()
        )
    finally:
        proc.kill()
        proc.wait()
    for read_it in (
        lambda: scan.read_holdings(proc.pid, scan.Matcher(("hostpool.",))),
        lambda: hostread.HostReader(set()).read(proc.pid),
    ):
        with pytest.raises(procfs.ProcessNotFoundError):
            read_it()
