"""`hostpool exporter` as a real server, scraped over HTTP, against real child processes."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import exporting, helpers
from tests.exporting import scrape, value

KiB, MiB = 1 << 10, 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")

# sglang's raw names (`sglang_host_pool_<hex>`, mapped with mmap: 2 fds each), one
# hostpool-named memfd, one foreign memfd. argv[1] is the hex the names start with.
CHILD = textwrap.dedent(
    """
    import mmap, os, sys
    tag, keep = sys.argv[1], []
    for i, (size, touched) in enumerate([(1 << 20, 1 << 20), (256 << 10, 3 * mmap.PAGESIZE)]):
        fd = os.memfd_create(f"sglang_host_pool_{tag}{i:08x}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        for off in range(0, touched, mmap.PAGESIZE):
            mm[off] = 1
        keep.append(mm)
    fd = os.memfd_create(f"hostpool.kv.{os.getpid()}.0", os.MFD_CLOEXEC)
    os.ftruncate(fd, 64 << 10)
    keep.append(mmap.mmap(fd, 64 << 10))
    keep.append(os.memfd_create(f"other.{tag}"))
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


@pytest.fixture
def tag() -> str:
    """Names unique to this test: other processes on the host may hold sglang memfds."""
    return secrets.token_hex(4)


@pytest.fixture
def start_child(tag: str) -> Iterator[Callable[[], subprocess.Popen[str]]]:
    children: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        proc = helpers.python_child(CHILD, tag)
        children.append(proc)
        return proc

    yield start
    for proc in children:
        proc.kill()
        proc.wait()


@pytest.fixture
def start_exporter() -> Iterator[Callable[..., str]]:
    """Starts `hostpool exporter ARGS --port 0`; returns its /metrics URL (from its log)."""
    servers: list[exporting.Exporter] = []

    def start(*args: str) -> str:
        servers.append(exporting.start_exporter(*args))
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()  # SIGTERM is a clean stop


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make prometheus)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_match_sums_raw_sglang_memfds_over_processes(
    tag: str,
    start_child: Callable[[], subprocess.Popen[str]],
    start_exporter: Callable[..., str],
) -> None:
    prefix = f"sglang_host_pool_{tag}"
    start_child()
    url = start_exporter("--match", prefix)
    text, samples = scrape(url)
    labels = {"prefix": prefix, "pool": "-"}
    assert value(samples, "hostpool_exporter_open_fds", **labels) == 4  # memfd + mmap's dup
    assert value(samples, "hostpool_exporter_mappings", **labels) == 2
    assert value(samples, "hostpool_exporter_mapped_bytes", **labels) == MiB + 256 * KiB
    assert value(samples, "hostpool_exporter_resident_bytes", **labels) == MiB + 3 * PAGE
    assert value(samples, "hostpool_exporter_processes", prefix=prefix) == 1
    assert {dict(key[1]).get("prefix") for key in samples} == {prefix, None}
    promtool_check(text)

    start_child()  # read at scrape time: a second holder shows up without a restart
    _, samples = scrape(url)
    assert value(samples, "hostpool_exporter_open_fds", **labels) == 8
    assert value(samples, "hostpool_exporter_resident_bytes", **labels) == 2 * (MiB + 3 * PAGE)
    assert value(samples, "hostpool_exporter_processes", prefix=prefix) == 2


def test_pid_exports_the_prefixes_it_uses_until_the_process_exits(
    start_child: Callable[[], subprocess.Popen[str]],
    start_exporter: Callable[..., str],
) -> None:
    child = start_child()
    url = start_exporter("--pid", str(child.pid))
    text, samples = scrape(url)
    sglang = {"prefix": "sglang_host_pool_", "pool": "-"}
    assert value(samples, "hostpool_exporter_open_fds", **sglang) == 4
    assert value(samples, "hostpool_exporter_mapped_bytes", **sglang) == MiB + 256 * KiB
    kv = {"prefix": "hostpool.", "pool": "kv"}
    assert value(samples, "hostpool_exporter_open_fds", **kv) == 2
    assert value(samples, "hostpool_exporter_mapped_bytes", **kv) == 64 * KiB
    assert value(samples, "hostpool_exporter_resident_bytes", **kv) == 0  # never touched
    assert value(samples, "hostpool_exporter_target_up", pid=str(child.pid)) == 1
    # --pid feeds no HostpoolExporterNoProcesses: that gauge is --match's
    assert not [k for k in samples if k[0] == "hostpool_exporter_processes"]
    promtool_check(text)

    child.kill()
    child.wait()
    text, samples = scrape(url)
    assert value(samples, "hostpool_exporter_target_up", pid=str(child.pid)) == 0
    assert not [k for k in samples if k[0] == "hostpool_exporter_open_fds"]
    promtool_check(text)


def test_missing_pid_exits_2_before_serving() -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    result = subprocess.run(
        [sys.executable, "-m", "hostpool", "exporter", "--pid", str(pid_max + 1), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"no process with pid {pid_max + 1}" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--match", "x", "--port", "99999"], "port must be 0..65535, got 99999"),
        (["--match", "x", "--port", "http"], "port must be a whole number, got 'http'"),
        (["--pid", "-3"], "pid must be 1..4194304, got -3"),
        (["--match", "x", "--max-pools", "1"], "--max-pools must be 2..10000, got 1"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hostpool", "exporter", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    # a usage error, not a traceback (the one-line format is the CLI parser's)
    assert message in result.stderr.splitlines()[-1] and "Traceback" not in result.stderr


# N memfds named after argv[1], each mapped (its fd + mmap's dup) with one page touched
MANY = textwrap.dedent(
    """
    import mmap, os, resource, sys
    prefix, n, keep = sys.argv[1], int(sys.argv[2]), []
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for i in range(n):
        fd = os.memfd_create(f"{prefix}.{os.getpid()}.{i}", os.MFD_CLOEXEC)
        os.ftruncate(fd, mmap.PAGESIZE)
        mm = mmap.mmap(fd, mmap.PAGESIZE)
        mm[0] = 1
        keep.append((fd, mm))
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def test_a_scrape_past_its_budget_returns_partial_sums_flagged(
    tag: str, start_exporter: Callable[..., str]
) -> None:
    """4 processes x 2,500 mapped memfds (20,000 fds) cannot be read in 1 ms on any
    machine: that scrape answers, flagged truncated, with less than everything; the same
    processes under the default budget give the full sums, unflagged."""
    prefix = f"hostpool.many{tag}"
    holders = [helpers.python_child(MANY, prefix, "2500") for _ in range(4)]
    try:
        full = scrape(start_exporter("--match", prefix))[1]
        cut = scrape(start_exporter("--match", prefix, "--scrape-budget", "0.001"))[1]
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
    pool = {"prefix": prefix, "pool": prefix.removeprefix("hostpool.")}
    assert value(full, "hostpool_exporter_scrape_truncated") == 0
    assert value(full, "hostpool_exporter_open_fds", **pool) == 4 * 2 * 2500
    assert value(full, "hostpool_exporter_mappings", **pool) == 4 * 2500
    assert value(full, "hostpool_exporter_resident_bytes", **pool) == 4 * 2500 * PAGE
    assert value(full, "hostpool_exporter_processes", prefix=prefix) == 4
    assert value(cut, "hostpool_exporter_scrape_truncated") == 1
    assert cut.get(("hostpool_exporter_open_fds", frozenset(pool.items())), 0) < 4 * 2 * 2500
    assert value(cut, "hostpool_exporter_processes", prefix=prefix) < 4


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("0", "--scrape-budget must be 0.001..300 seconds, got 0"),
        ("nan", "--scrape-budget must be 0.001..300 seconds, got nan"),
        ("5s", "--scrape-budget must be a number of seconds, got '5s'"),
    ],
)
def test_bad_scrape_budgets_are_one_line_usage_errors(budget: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hostpool", "exporter", "--match", "x", "--scrape-budget", budget],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr.splitlines()[-1] and "Traceback" not in result.stderr


def test_the_cli_default_budget_is_the_collectors() -> None:
    from hostpool.cli import exporter as cli
    from hostpool.metrics.exporter import DEFAULT_SCRAPE_BUDGET

    assert cli.DEFAULT_SCRAPE_BUDGET == DEFAULT_SCRAPE_BUDGET < 10  # Prometheus' timeout
