"""Permission advice that helps: the real `hostpool inspect` run where /proc refuses it,
for each real cause, says what is actually missing (CAP_SYS_PTRACE, hidepid, a PID
namespace) instead of "run as the process's user or as root"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import pytest

from tests import helpers
from tests.reliability.results import record_procfs_attack as record

GENERIC = "run as the process's user or as root"
NO_PTRACE = ["setpriv", "--bounding-set", "-sys_ptrace", "--inh-caps", "-sys_ptrace", "--"]
HOLDER = """
import ctypes, os, sys
fd = os.memfd_create(f"hostpool.acc.{os.getpid()}.0")
if sys.argv[1] == "nodump":
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
print("ready", flush=True)
sys.stdin.read()
"""
_causes: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def record_causes() -> Iterator[None]:
    yield
    record("permission_advice", causes_explained=sorted(_causes))


@pytest.fixture(autouse=True)
def tools(root: None) -> None:
    for tool in ("setpriv", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} (util-linux) is not installed")


def inspect(pid: int, *, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "hostpool", "inspect", str(pid)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@contextmanager
def holder(*wrapper: str, mode: str = "plain") -> Iterator[int]:
    proc = subprocess.Popen(
        [*wrapper, sys.executable, "-c", textwrap.dedent(HOLDER), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def nobody_holder() -> AbstractContextManager[int]:
    """A process of uid 65534 holding a hostpool memfd (forked: that uid cannot exec the
    venv's interpreter under /root)."""
    return helpers.held_child(lambda: os.memfd_create(f"hostpool.acc.{os.getpid()}.0"), uid=65534)


def denied(result: subprocess.CompletedProcess[str], cause: str) -> str:
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("hostpool inspect: permission denied reading /proc/")
    assert GENERIC not in result.stderr
    _causes.append(cause)
    return result.stderr


def test_root_without_cap_sys_ptrace_reading_another_uid() -> None:
    with nobody_holder() as pid:
        assert inspect(pid).returncode == 0  # full root reads it
        err = denied(inspect(pid, prefix=NO_PTRACE), "root without CAP_SYS_PTRACE, other uid")
    assert "it runs as uid 65534 gid 65534 and you as uid 0 gid 0;" in err
    assert "needs CAP_SYS_PTRACE, which this process lacks" in err
    assert "CAP_DAC_READ_SEARCH" not in err  # root still has it: not what is missing


def test_root_without_cap_sys_ptrace_reading_a_more_privileged_root_process() -> None:
    with holder() as pid:
        err = denied(inspect(pid, prefix=NO_PTRACE), "root without CAP_SYS_PTRACE, full root")
    assert "it runs as you but holds capabilities this process lacks (CAP_SYS_PTRACE)" in err
    assert "needs CAP_SYS_PTRACE" in err


def test_a_process_that_is_not_dumpable() -> None:
    with holder(*NO_PTRACE, mode="nodump") as pid:  # same uid and capabilities as the reader
        with holder(*NO_PTRACE) as dumpable:
            assert inspect(dumpable, prefix=NO_PTRACE).returncode == 0  # the control
        err = denied(inspect(pid, prefix=NO_PTRACE), "not dumpable")
    assert "not dumpable (prctl PR_SET_DUMPABLE 0" in err
    assert "needs CAP_SYS_PTRACE, which this process lacks" in err


HIDEPID = """
import os, sys
from hostpool.cli import build_parser
args = build_parser().parse_args(["inspect", sys.argv[1]])
pid = os.fork()
if pid == 0:  # the uid that hidepid hides root's processes from
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    os._exit(args.run(args))
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_proc_mounted_hidepid_invisible() -> None:
    """A private mount namespace whose /proc is remounted hidepid=invisible (this host's
    /proc is untouched); inspect runs there as uid 65534 against a root process."""
    with holder() as pid:
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount -t proc -o hidepid=invisible proc /proc && exec "$@"', "sh",
             sys.executable, "-c", HIDEPID, str(pid)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    if "mount" in result.stderr and result.returncode != 2:
        pytest.skip(f"cannot mount /proc here: {result.stderr.strip()}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"hostpool inspect: no process with pid {pid} visible here")
    assert "/proc is mounted with hidepid=invisible" in result.stderr
    _causes.append("/proc mounted hidepid=invisible")


def test_a_pid_namespace() -> None:
    with holder() as pid:
        result = inspect(pid, prefix=["unshare", "--pid", "--fork", "--mount-proc"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"hostpool inspect: no process with pid {pid} visible here")
    assert "this command runs in a PID namespace (its pid is" in result.stderr
    _causes.append("a PID namespace")
