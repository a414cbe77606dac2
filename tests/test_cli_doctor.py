"""`hostpool doctor` agrees with the kernel's own files, read independently here."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import pytest

from hostpool.base.units import format_size
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hostpool", "doctor", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * (1024 if "kB" in value else 1)
    return out


def _sys(size_kb: int, name: str) -> int:
    with open(f"/sys/kernel/mm/hugepages/hugepages-{size_kb}kB/{name}") as f:
        return int(f.read())


def within(a: int, b: int, fraction: float = 0.01) -> bool:
    return abs(a - b) <= fraction * max(a, b, 1)


def test_json_agrees_with_proc_sys_and_statvfs(root: None) -> None:
    with helpers.reserved_hugepages(6):
        proc = doctor("--json")
        meminfo = _meminfo()
        st = os.statvfs("/dev/shm")
        report = json.loads(proc.stdout)
        host = report["host"]
        assert proc.returncode == 0
        assert host["kernel"] == os.uname().release
        assert host["memory"]["total_bytes"] == meminfo["MemTotal"]  # static: exact
        assert within(host["memory"]["available_bytes"], meminfo["MemAvailable"])
        two = host["hugepages"]["2MiB"]
        assert two["total"] == _sys(2048, "nr_hugepages") == 6
        assert two["free"] == _sys(2048, "free_hugepages")
        assert two["reserved"] == _sys(2048, "resv_hugepages")
        assert host["dev_shm"]["size_bytes"] == st.f_blocks * st.f_frsize
        assert within(host["dev_shm"]["free_bytes"], st.f_bavail * st.f_frsize)
        assert host["memfd"] and host["sealing"] and host["madv_populate_write"]
        assert report["plan"]["page_size"] == 2 << 20  # auto with prefer takes the hugepages


@pytest.mark.parametrize(
    "args,ok",
    [
        (("--need", "1MiB"), True),
        (("--need", "64TiB"), False),
        (("--hugepages", "required", "--need", "1TiB"), False),
    ],
)
def test_requests_that_cannot_be_met_exit_1(args: tuple[str, ...], ok: bool) -> None:
    proc = doctor(*args)
    assert proc.returncode == (0 if ok else 1), proc.stdout + proc.stderr
    assert ("PROBLEM" in proc.stdout) == (not ok)


def test_bad_input_exits_2() -> None:
    assert doctor("--need", "lots").returncode == 2


def test_text_output_has_no_python_reprs_or_raw_byte_counts() -> None:
    """Sizes are human (8MiB, not 8388608), lists are words, not ['a', 'b']."""
    proc = doctor("--hugepages", "prefer", "--need", "64TiB")
    assert proc.returncode == 1
    for line in proc.stdout.splitlines():
        assert not re.search(r"[\[\]{}']", line.split(" ", 1)[1]), line
        assert not re.search(r"\b\d{7,}\b", line), line  # no byte count of 1 MB or more
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    expected = "unlimited" if memlock == resource.RLIM_INFINITY else format_size(memlock)
    assert f"RLIMIT_MEMLOCK       {expected} " in proc.stdout
    assert "PROBLEM: need 64TiB but MemAvailable is " in proc.stdout
