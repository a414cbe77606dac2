"""`hostpool inspect` against a real child process holding real memfds and mappings."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from hostpool.cli.inspect import default_prefixes
from tests import helpers

KiB, MiB = 1 << 10, 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")

# Three pools named the way hostpool names memfds, one sglang raw name, one foreign name.
# Python's mmap dup()s the fd: each mmap.mmap adds one fd for the same memfd.
CHILD = textwrap.dedent(
    """
    import ctypes, json, mmap, os, sys
    pid = os.getpid()
    keep, fds = [], {}

    def memfd(pool, seq, size):
        name = f"hostpool.{pool}.{pid}.{seq}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        fds[name] = fd
        return fd

    def touch(mm, pages):
        for i in range(pages):
            mm[i * mmap.PAGESIZE] = 1

    a1 = mmap.mmap(memfd("alpha", 1, 1 << 20), 1 << 20)          # 2 fds, 1 mapping
    touch(a1, 3)
    fd = memfd("alpha", 2, 3 << 19)                                # 3 fds, 2 mappings
    a2, a2_again = mmap.mmap(fd, 3 << 19), mmap.mmap(fd, 3 << 19)
    touch(a2, 5)
    b1 = mmap.mmap(memfd("beta", 3, 512 << 10), 512 << 10)       # 2 fds, 1 mapping
    touch(b1, (512 << 10) // mmap.PAGESIZE)
    # gamma: one mapping whose fd is closed (mapped with libc: no hidden dup) and one fd
    # that is never mapped
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    fd = memfd("gamma", 4, 64 << 10)
    addr = libc.mmap(None, 64 << 10, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    ctypes.memset(addr, 1, 64 << 10)
    os.close(fd)
    del fds[f"hostpool.gamma.{pid}.4"]
    memfd("gamma", 5, 8 << 10)                                     # 1 fd, 0 mappings
    fds["sglang_host_pool_" + "ab" * 16] = os.memfd_create("sglang_host_pool_" + "ab" * 16)
    fds["other.x"] = os.memfd_create("other.x")
    keep += [a1, a2, a2_again, b1]
    print(json.dumps(fds), flush=True)
    sys.stdin.readline()
    """
)


@dataclass
class Child:
    proc: subprocess.Popen[str]
    fds: dict[str, int]  # memfd name -> the fd memfd_create returned

    @property
    def pid(self) -> int:
        return self.proc.pid


@pytest.fixture
def shm_child() -> Iterator[Child]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        yield Child(proc, json.loads(proc.stdout.readline()))
    finally:
        proc.kill()
        proc.wait()


def inspect(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hostpool", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )


def test_json_reports_exactly_the_childs_fds_mappings_and_bytes(shm_child: Child) -> None:
    result = inspect(str(shm_child.pid), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["pid"] == shm_child.pid
    pools = {(p["prefix"], p["pool"]): p for p in doc["pools"]}
    assert set(pools) == {
        ("hostpool.", "alpha"),
        ("hostpool.", "beta"),
        ("hostpool.", "gamma"),
        ("sglang_host_pool_", "-"),
    }

    def row(p: dict[str, Any]) -> tuple[int, ...]:
        return (p["objects"], p["open_fds"], p["mappings"], p["mapped_bytes"], p["resident_bytes"])

    assert row(pools["hostpool.", "alpha"]) == (2, 5, 3, MiB + 2 * 1536 * KiB, 8 * PAGE)
    assert row(pools["hostpool.", "beta"]) == (1, 2, 1, 512 * KiB, 512 * KiB)
    assert row(pools["hostpool.", "gamma"]) == (2, 1, 1, 64 * KiB, 64 * KiB)
    assert row(pools["sglang_host_pool_", "-"]) == (1, 1, 0, 0, 0)
    assert pools["hostpool.", "alpha"]["page_sizes"] == [PAGE]

    objects = {o["name"]: o for o in doc["objects"]}
    assert "other.x" not in objects
    for name, fd in shm_child.fds.items():
        if name != "other.x":
            assert fd in objects[name]["fds"], name  # the fd memfd_create returned
    assert sorted(objects[n]["size"] for n in objects if ".alpha." in n) == [MiB, 1536 * KiB]

    findings = {(f["kind"], f["name"].split(".")[1] if "." in f["name"] else f["name"])
                for f in doc["findings"]}  # fmt: skip
    assert findings == {
        ("mapped_twice", "alpha"),
        ("mapping_without_fd", "gamma"),
        ("fd_without_mapping", "gamma"),
        ("fd_without_mapping", "sglang_host_pool_" + "ab" * 16),
    }


def test_prefix_option_selects_names(shm_child: Child) -> None:
    result = inspect(str(shm_child.pid), "--json", "--prefix", "sglang_host_pool_")
    doc = json.loads(result.stdout)
    assert [(p["pool"], p["open_fds"]) for p in doc["pools"]] == [("-", 1)]
    result = inspect(str(shm_child.pid), "--json", "--prefix", "hostpool.beta")
    doc = json.loads(result.stdout)
    assert [(p["prefix"], p["pool"]) for p in doc["pools"]] == [("hostpool.beta", "beta")]


def test_plain_text_off_a_tty_and_a_table_on_one(shm_child: Child) -> None:
    plain = inspect(str(shm_child.pid)).stdout.splitlines()
    head = plain[0].split()
    assert head[:3] == ["process", f"pid={shm_child.pid}", "command=python"]
    stamp = datetime.fromisoformat(head[3].removeprefix("time="))
    assert abs(stamp.timestamp() - time.time()) < 60 and stamp.tzinfo is not None
    assert head[4:] == ["pools=4", "findings=4"]
    assert (
        "pool prefix=hostpool. pool=beta objects=1 fds=2 mappings=1 mapped=512KiB "
        "resident=512KiB page_sizes=4KiB"
    ) in plain
    assert (
        "pool prefix=hostpool. pool=alpha objects=2 fds=5 mappings=3 mapped=4MiB "
        "resident=32KiB page_sizes=4KiB"
    ) in plain
    assert any(line.startswith("finding kind=mapped_twice prefix=hostpool. pool=alpha ")
               for line in plain)  # fmt: skip

    code, text = helpers.hostpool_on_tty("inspect", str(shm_child.pid))
    assert code == 0
    table = text.splitlines()
    assert re.fullmatch(
        rf"pid {shm_child.pid} \(python\) at \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \S+", table[0]
    ), table[0]
    assert table[1].split() == [
        "PREFIX", "POOL", "OBJECTS", "FDS", "MAPPINGS", "MAPPED", "RESIDENT", "PAGE"
    ]  # fmt: skip
    assert ["hostpool.", "beta", "1", "2", "1", "512KiB", "512KiB", "4KiB"] in [
        line.split() for line in table
    ]


def test_a_process_without_shared_memory_is_said_so() -> None:
    child = helpers.python_child("print('ready', flush=True); import sys; sys.stdin.read()")
    try:
        result = inspect(str(child.pid))
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0].split(" ", 5)[4:] == [
            "pools=0",
            f'findings=0 note="no shared memory named {" or ".join(default_prefixes())}"',
        ]
        code, text = helpers.hostpool_on_tty("inspect", str(child.pid), "--prefix", "myapp_")
        assert code == 0
        assert text.rstrip().endswith(": no shared memory named myapp_"), text
        assert text.startswith(f"pid {child.pid} (python) at ")
        doc = json.loads(inspect(str(child.pid), "--json").stdout)
        assert (doc["pools"], doc["objects"], doc["command"]) == ([], [], "python")
    finally:
        child.kill()
        child.wait()


def test_check_exits_1_on_findings_for_scripts(shm_child: Child) -> None:
    result = inspect(str(shm_child.pid), "--check")
    assert result.returncode == 1
    assert result.stderr == f"hostpool inspect: 4 finding(s) in pid {shm_child.pid}\n"
    assert "finding kind=mapped_twice" in result.stdout  # the report is still printed
    clean = inspect(str(shm_child.pid), "--check", "--json", "--prefix", "hostpool.beta")
    assert (clean.returncode, json.loads(clean.stdout)["findings"]) == (0, [])
    both = inspect(str(shm_child.pid), "--check", "--watch", "1")
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr


def test_watch_repeats_and_exits_1_when_the_process_ends(shm_child: Child) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostpool", "inspect", str(shm_child.pid), "--json",
         "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    first, second = json.loads(proc.stdout.readline()), json.loads(proc.stdout.readline())
    assert first["pools"] == second["pools"] and second["time"] > first["time"]
    shm_child.proc.kill()
    shm_child.proc.wait()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"process {shm_child.pid} exited" in err


def test_missing_pid_exits_2() -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    result = inspect(str(pid_max + 1))
    assert result.returncode == 2
    assert f"no process with pid {pid_max + 1}" in result.stderr
    assert result.stdout == ""


def test_an_unreadable_process_exits_1_with_a_permission_message(
    root: None, shm_child: Child
) -> None:
    """inspect runs as uid 65534 (forked after imports: that uid cannot exec the venv's
    interpreter under /root) against the child running as root."""
    import psutil  # noqa: F401  (procfs imports it lazily; the child could not)

    from hostpool.cli import build_parser

    # main() minus its logging setup, which would import modules the child cannot read
    args = build_parser().parse_args(["inspect", str(shm_child.pid)])

    def inspect_as_nobody() -> str:
        err, out = io.StringIO(), io.StringIO()
        with redirect_stderr(err), redirect_stdout(out):
            code = args.run(args)
        return f"code={code} out={out.getvalue()!r} err={err.getvalue()}"

    code, text = helpers.run_forked(inspect_as_nobody, uid=65534)
    assert code == 0, text
    assert text.startswith("code=1 out='' err=hostpool inspect: permission denied reading "), text
    assert "it runs as uid 0 gid 0 and you as uid 65534 gid 65534;" in text
    assert "needs CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH" in text


ENGINES_CHILD = """
import mmap, os, sys
keep = []
for name in ("vllm_offload_engine0.mmap", "torch_1_2_3"):
    fd = os.memfd_create(name)
    os.ftruncate(fd, 1 << 16)
    keep.append(mmap.mmap(fd, 1 << 16))
print("ready", flush=True)
sys.stdin.readline()
"""


def test_default_prefixes_follow_the_engine_table() -> None:
    """vLLM's offload memory (its `vllm_offload_*` name) is reported with no --prefix, as
    every engine row of hostpool.host.engines is; torch's own shared memory is not."""
    from hostpool.host.engines import ENGINE_PATTERNS

    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINES_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        doc = json.loads(inspect(str(proc.pid), "--json").stdout)
    finally:
        proc.kill()
        proc.wait()
    rows = {r.engine: r.pattern for r in ENGINE_PATTERNS}
    assert rows["vllm"] == "vllm_offload_*" and rows["torch"] == "torch_*"
    assert {"hostpool.", "sglang_host_pool_", "vllm_offload_"} <= set(doc["prefixes"])
    assert "torch_" not in doc["prefixes"]
    pools = [(p["prefix"], p["mapped_bytes"]) for p in doc["pools"]]
    assert pools == [("vllm_offload_", 1 << 16)]
