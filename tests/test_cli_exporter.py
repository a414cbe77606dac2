"""`hostpool exporter` as a real server, scraped over HTTP, against real child processes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import exporting, helpers
from tests.exporting import scrape, value
from tests.helpers import start_exporter

__all__ = ["start_exporter"]  # the fixture
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


def free_pid() -> int:
    """A pid no process has now, below pid_max (so the kernel can hand it out)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    for pid in [*range(last + 2000, pid_max - 1, 997), *range(300, last, 997)]:
        if not Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError("no free pid")


def born_with_pid(pid: int) -> subprocess.Popen[str] | None:
    """A child that gets `pid` (root: the kernel's ns_last_pid picks the next pid), or
    None when another fork on the host took it first."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    proc = subprocess.Popen(["sleep", "600"], text=True)
    if proc.pid == pid:
        return proc
    proc.kill()
    proc.wait()
    return None


def test_pid_of_a_process_not_started_yet_is_watched_until_it_starts() -> None:
    pid = free_pid()
    with exporting.running_exporter("--pid", str(pid)) as exporter:
        assert exporter.serving["level"] == "info"  # startup is news, not a warning
        assert exporter.serving["pid"] == pid
        assert exporter.proc.stderr is not None
        waiting = json.loads(exporter.proc.stderr.readline())
        assert (waiting["event"], waiting["pid"], waiting["level"]) == (
            "hostpool.exporter_waiting",
            pid,
            "info",
        )
        _, samples = scrape(exporter.url)
        assert value(samples, "hostpool_exporter_target_up", pid=str(pid)) == 0
        if os.geteuid() != 0:
            return  # only root can have the kernel hand out a chosen pid
        child = None
        for _ in range(20):  # another fork on a busy host may take it first
            child = born_with_pid(pid)
            if child is not None:
                break
        if child is None:
            pytest.skip(f"pid {pid} kept being taken by other processes")
        try:
            _, samples = scrape(exporter.url)
            assert value(samples, "hostpool_exporter_target_up", pid=str(pid)) == 1
        finally:
            child.kill()
            child.wait()
        _, samples = scrape(exporter.url)
        assert value(samples, "hostpool_exporter_target_up", pid=str(pid)) == 0
        exporter.stop()


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_metrics_only_on_its_path_a_landing_page_and_healthz(
    start_exporter: Callable[..., str],
) -> None:
    metrics = start_exporter("--match", "hostpool.")
    base = metrics.removesuffix("/metrics")
    status, kind, text = get(metrics)
    assert status == 200 and "hostpool_exporter_processes" in text
    status, kind, page = get(base + "/")
    assert status == 200 and kind.startswith("text/html")
    assert '<a href="/metrics">' in page and '<a href="/healthz">' in page
    assert "hostpool_exporter" not in page
    assert get(base + "/healthz")[::2] == (200, "ok\n")
    for path in ("/healthz/x", "/metrics/", "/metricsx", "/debug/pools", "/favicon.ico"):
        status, _, body = get(base + path)
        assert status == 404, path
        assert "hostpool_exporter" not in body and "/metrics" in body, path


NO_PTRACE = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"]


@pytest.fixture
def other_uid_child() -> Iterator[int]:
    """A process of uid 65534 (forked: that uid cannot exec this interpreter), alive
    until the test ends."""
    with helpers.held_child(lambda: None, uid=65534) as pid:
        yield pid


def unreadable_event(*args: str) -> dict[str, object]:
    """`hostpool exporter ARGS` as root without CAP_SYS_PTRACE, scraped once: its
    `hostpool.exporter_unreadable` event."""
    exporter = subprocess.Popen(
        [*NO_PTRACE, sys.executable, "-m", "hostpool", "exporter", *args, "--port", "0"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert exporter.stderr is not None
    try:
        serving = json.loads(exporter.stderr.readline())
        assert serving["event"] == "hostpool.exporter_serving", serving
        scrape(serving["url"])
    finally:
        exporter.terminate()
        err = exporter.stderr.read()  # to EOF: SIGTERM is a clean stop
        exporter.wait(timeout=60)
    events = [json.loads(e) for e in err.splitlines() if e.startswith("{")]
    found = [e for e in events if e["event"] == "hostpool.exporter_unreadable"]
    assert len(found) == 1, err
    event: dict[str, object] = found[0]
    return event


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv")
def test_unreadable_processes_are_named_by_pid_without_advice_to_be_root(
    root: None, other_uid_child: int
) -> None:
    """Root without CAP_SYS_PTRACE cannot read another uid's fds. Every message names
    the pid(s) and what is missing, and none tells root to run as root."""
    pid = other_uid_child
    one = unreadable_event("--pid", str(pid))
    assert (one["processes"], one["pids"]) == (1, [pid]), one
    detail = str(one["detail"])
    assert f"/proc/{pid}/" in detail and "CAP_SYS_PTRACE" in detail, one
    assert "as root" not in detail, one

    every = unreadable_event("--match", "hostpool.")
    pids = every["pids"]
    assert isinstance(pids, list) and (pid in pids or len(pids) == 10), every
    assert len(pids) == min(int(str(every["processes"])), 10), every
    assert str(every["detail"]).startswith(f"pid {pids[0]}: "), every
    assert "as root" not in str(every["detail"]), every


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
