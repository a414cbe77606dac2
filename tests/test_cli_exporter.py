"""`hostpool exporter` as a real server, scraped over HTTP, against real child processes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import helpers

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

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


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
    servers: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hostpool", "exporter", *args, "--port", "0"],
            stderr=subprocess.PIPE,
            text=True,
        )
        servers.append(proc)
        assert proc.stderr is not None
        line = proc.stderr.readline()
        event = json.loads(line)  # stderr is not a TTY: JSON log lines
        assert event["event"] == "hostpool.exporter_serving", line
        url: str = event["url"]
        assert url.startswith("http://127.0.0.1:")
        return url

    yield start
    for proc in servers:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM is a clean stop


def scrape(url: str) -> tuple[str, Samples]:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


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


def test_pid_exports_every_known_prefix_until_the_process_exits(
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
    assert value(samples, "hostpool_exporter_processes", prefix="hostpool.") == 1
    promtool_check(text)

    child.kill()
    child.wait()
    text, samples = scrape(url)
    assert value(samples, "hostpool_exporter_processes", prefix="hostpool.") == 0
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
