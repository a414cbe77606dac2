"""`hostpool serve` as a new user runs it: a real process, real HTTP, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests import helpers, waiting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str
    stderr_path: str

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=waiting.DEADLINE) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def log(self) -> str:
        with open(self.stderr_path) as f:
            return f.read()

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it: its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=waiting.DEADLINE)

    def kill(self) -> None:
        """SIGKILL if it still runs (a failed test's cleanup)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_serve(tmp_path: os.PathLike[str], *args: str) -> Served:
    """`hostpool serve --port 0 ARGS`, once `serving` named the URL: every pool is
    populated and the listener is up."""
    err = os.path.join(tmp_path, "serve.err")
    proc, url = helpers.start_hostpool(
        err, "serve", "--port", "0", *args, url=r'"url": "(http://[^"]+)/metrics"'
    )
    return Served(proc, url, err)


@pytest.fixture
def served(tmp_path: os.PathLike[str]) -> Iterator[Served]:
    s = start_serve(tmp_path, "--log-level", "debug")  # each release is a debug event
    yield s
    s.kill()


def test_endpoints_and_clean_sigterm(served: Served) -> None:
    status, metrics = served.get("/metrics")
    assert status == 200
    assert (
        'hostpool_allocated_bytes{allocator="shm",page_size="4KiB",pool="kv"} 6.7108864e+07'
        in metrics
    )
    assert "process_open_fds" in metrics and "python_info" in metrics
    status, debug = served.get("/debug/pools")
    doc = json.loads(debug)
    assert status == 200 and doc["pools"]["kv"]["bytes"] == 64 << 20
    assert {r["pool"] for r in doc["regions"]} == {"kv", "swa", "mamba"}
    assert served.get("/healthz") == (200, "ok\n")
    assert served.get("/nope")[0] == 404
    assert served.stop() == 0
    releases = [
        json.loads(line) for line in served.log().splitlines() if "hostpool.release" in line
    ]
    assert {(r["pool"], r["how"]) for r in releases} == {
        ("kv", "explicit"),
        ("swa", "explicit"),
        ("mamba", "explicit"),
    }
    # A clean shutdown reads as one: no release says the pages are "still mapped", and
    # nothing is logged above info.
    assert "still_mapped" not in served.log()
    assert {r["unmap"] for r in releases} <= {"now", "with_last_view"}
    logged = [json.loads(x) for x in served.log().splitlines() if x.startswith("{")]
    assert [e for e in logged if e["level"] not in ("debug", "info")] == []
    assert "hostpool.leak" not in served.log()
    serving = [json.loads(x) for x in served.log().splitlines() if '"hostpool.serving"' in x]
    assert [e["level"] for e in serving] == ["info"]  # the normal case is not a warning
    # The server's shm went with it: no process holds or maps a memfd it named (not the
    # host's Shmem, which every other process on the machine moves).
    for pool in ("kv", "swa"):  # mamba is anonymous memory: it has no name to look for
        assert waiting.shm_holders(f"hostpool.{pool}.{served.proc.pid}.") == []


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (make test installs it)"
)
def test_promtool_accepts_the_metrics(served: Served) -> None:
    _, metrics = served.get("/metrics")
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=metrics, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip() == "" and check.stderr.strip() == ""


def test_bad_config_exits_2_naming_the_key(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "bad.toml")
    with open(path, "w") as f:
        f.write('[pools.kv]\nsize = "4 potatoes"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "hostpool", "serve", "--config", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "pools.kv.size" in proc.stderr


@pytest.mark.parametrize(
    "toml,key",
    [
        ('[pools.kv]\nsize = "1MiB"\nhugepages = "always"\n', "pools.kv.hugepages"),
        ('[pools.kv]\nsize = "1MiB"\nallocator = "gpu"\n', "pools.kv.allocator"),
        ('[pools."k v"]\nsize = "1MiB"\n', "pools.k v"),
        ('[server]\nport = "http"\n[pools.kv]\nsize = "1MiB"\n', "server.port"),
        ("[pools.kv]\ncolour = 1\nsize = 1\n", "pools.kv"),
        ("[pools.kv]\n", "pools.kv.size"),
    ],
)
def test_config_errors_name_their_key(toml: str, key: str) -> None:
    import tomllib

    from hostpool.errors import ConfigError
    from hostpool.serve.config import from_mapping

    with pytest.raises(ConfigError, match=re.escape(key)):
        from_mapping(tomllib.loads(toml))


def test_flags_build_pools(tmp_path: os.PathLike[str]) -> None:
    s = start_serve(tmp_path, "--pool", "kv=2MiB", "--pool", "idx=1MiB", "--allocator", "mmap")
    try:
        doc = json.loads(s.get("/debug/pools")[1])
        assert {r["pool"]: (r["allocator"], r["mapped_bytes"]) for r in doc["regions"]} == {
            "kv": ("mmap", 2 << 20),
            "idx": ("mmap", 1 << 20),
        }
    finally:
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=10) == 0


def test_sigterm_removes_the_share_socket(tmp_path: os.PathLike[str]) -> None:
    sock = os.path.join(tmp_path, "run", "share.sock")
    s = start_serve(tmp_path, "--pool", "kv=1MiB", "--share-socket", sock)
    assert os.path.exists(sock)  # bound before `serving` is logged
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=10) == 0
    assert not os.path.exists(sock) and not os.path.exists(os.path.dirname(sock))


def test_host_budget_reservation_file_goes_with_the_server(tmp_path: os.PathLike[str]) -> None:
    budget_dir = os.path.join(tmp_path, "budget")
    s = start_serve(
        tmp_path, "--pool", "kv=2MiB", "--host-budget", "64MiB", "--budget-dir", budget_dir
    )
    reservations = [n for n in os.listdir(budget_dir) if not n.startswith(".")]
    assert len(reservations) >= 1
    doc = json.loads(s.get("/debug/pools")[1])
    assert doc["budget_bytes"] == 64 << 20
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=10) == 0
    assert [n for n in os.listdir(budget_dir) if not n.startswith(".")] == []


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_run_as_a_new_user_would(tmp_path: os.PathLike[str]) -> None:
    """`make run`, then curl, then Ctrl-C (SIGINT to the whole process group)."""
    err = os.path.join(tmp_path, "make-run.err")
    with open(err, "w") as f:
        proc = subprocess.Popen(
            ["make", "--no-print-directory", "run", "SERVE_ARGS=--port 0 --log-level debug"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=f,
            start_new_session=True,
        )
    try:
        # a first `make run` installs everything: a long upper bound
        text = waiting.wait_for_log(err, '/metrics"', alive=proc, timeout=900)
        match = re.search(r'"url": "(http://[^"]+)/metrics"', text)
        assert match is not None, text
        url = match.group(1)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert b"hostpool_allocated_bytes" in r.read()
        with urllib.request.urlopen(url + "/healthz", timeout=10) as r:
            assert r.read() == b"ok\n"
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(err) as f:
        log = f.read()
    assert "hostpool.serve_stopped" in log
    releases = [json.loads(x) for x in log.splitlines() if "hostpool.release" in x]
    assert releases and {r["how"] for r in releases} == {"explicit"}


def hostpool(*args: str, importtime: bool = False) -> subprocess.CompletedProcess[str]:
    """The real `hostpool` command (`-X importtime` lists every module it imported)."""
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "hostpool", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def imported_torch(stderr: str) -> bool:
    return any(re.search(r"\|\s*torch$", line.rstrip()) for line in stderr.splitlines())


def log_events(stderr: str) -> list[str]:
    return re.findall(r'"event": "(hostpool\.[a-z_]+)"', stderr)


def test_a_pool_bigger_than_the_host_is_refused_before_anything_is_allocated() -> None:
    proc = hostpool("serve", "--port", "0", "--pool", "kv=10TiB", importtime=True)
    assert proc.returncode == 1, proc.stderr  # this host's memory: exit 1, as kv=22GiB
    assert "kv 10TiB" in proc.stderr and "MemTotal" in proc.stderr
    assert "hostpool.alloc" not in log_events(proc.stderr)
    assert not imported_torch(proc.stderr)


def test_pools_over_the_budget_are_refused_naming_it() -> None:
    proc = hostpool("serve", "--port", "0", "--pool", "kv=48MiB", "--pool", "swa=32MiB",
                    "--budget", "64MiB")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--budget 64MiB" in proc.stderr and "80MiB" in proc.stderr
    assert log_events(proc.stderr) == []


def test_a_port_in_use_is_reported_before_torch_or_allocation() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = hostpool("serve", "--port", str(port), "--pool", "kv=1MiB", importtime=True)
    assert proc.returncode == 1, proc.stderr  # not now: systemd retries it
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert not imported_torch(proc.stderr)
    assert log_events(proc.stderr) == []


@pytest.mark.parametrize(
    "args,message",
    [
        (["--allocator", "gpu"], "--allocator: unknown 'gpu'"),
        (["--hugepages", "always"], "argument --hugepages: invalid choice"),
        (["--port", "99999"], "--port must be an int in 0..65535"),
    ],
)
def test_bad_flags_are_reported_before_torch(args: list[str], message: str) -> None:
    proc = hostpool("serve", "--pool", "kv=1MiB", *args, importtime=True)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not imported_torch(proc.stderr)


def test_check_validates_without_allocating() -> None:
    ok = hostpool("serve", "--check", "--port", "0", "--pool", "kv=1GiB", importtime=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok: 1 pools (kv 1GiB (shm)); listen 127.0.0.1:0")
    assert not imported_torch(ok.stderr)
    bad = hostpool("serve", "--check", "--pool", "kv=10TiB")
    assert bad.returncode == 1 and "MemTotal" in bad.stderr and bad.stdout == ""


@pytest.mark.parametrize(
    "args,message",
    [
        (["--log-level", "bogus", "doctor"], "argument --log-level: invalid choice: 'bogus'"),
        (["serve", "--pool", "kv=4GiB", "--pool", "kv=1GiB"], "--pool kv is given twice"),
        (["serve", "--pool", "kv"], "--pool takes NAME=SIZE"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    proc = hostpool(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_version_and_help_say_the_syntax() -> None:
    from importlib.metadata import version

    proc = hostpool("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"hostpool {version('hostpool')}"
    help_text = " ".join(hostpool("serve", "--help").stdout.split())
    assert "--pool kv=4GiB --pool swa=512MiB" in help_text
    assert "KiB, MiB, GiB, TiB (KB, MB, GB, TB and K, M, G, T mean the same: powers of 1024" in (
        help_text
    )
    assert "hostpool.share.attach(PATH, POOL)" in help_text
    assert "--check" in help_text and "--log-format" in hostpool("--help").stdout


def test_builtin_allocator_names_match_the_registry() -> None:
    from hostpool.core.allocators import allocator_names
    from hostpool.serve.config import BUILTIN_ALLOCATORS

    fresh = helpers.run_python(
        "from hostpool.core.allocators import allocator_names; print(allocator_names())"
    )
    assert fresh.stdout.strip() == str(sorted(BUILTIN_ALLOCATORS))
    assert set(BUILTIN_ALLOCATORS) <= set(allocator_names())


@contextlib.contextmanager
def _share_socket_problem(tmp_path: os.PathLike[str], problem: str) -> Iterator[tuple[str, str]]:
    """A share-socket path with `problem` while the block runs, and what the error names."""
    if problem == "in-use":
        path = os.path.join(tmp_path, "live.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as live:
            live.bind(path)
            live.listen()
            yield path, "already listening"
        return
    if problem == "too-long":
        yield os.path.join(tmp_path, "x" * 120 + ".sock"), "at most 107"
    elif problem == "proc":
        yield "/proc/hostpool-test/share.sock", "/proc"
    elif problem == "proc-dir":
        yield "/proc/share.sock", "procfs"
    else:
        path = os.path.join(tmp_path, "file.sock")
        with open(path, "w") as f:
            f.write("not a socket")
        yield path, "not a socket"


SHARE_SOCKET_PROBLEMS = ["in-use", "too-long", "proc", "proc-dir", "not-a-socket"]


def _share_socket_status(problem: str) -> int:
    """A live server holds the path (1: not now, retried); the others are wrong paths (2)."""
    return 1 if problem == "in-use" else 2


@pytest.mark.parametrize("problem", SHARE_SOCKET_PROBLEMS)
def test_share_socket_problems_fail_check_in_one_line(
    tmp_path: os.PathLike[str], problem: str
) -> None:
    with _share_socket_problem(tmp_path, problem) as (path, names):
        proc = hostpool("serve", "--check", "--port", "0", "--pool", "kv=1MiB",
                        "--share-socket", path)  # fmt: skip
    assert proc.returncode == _share_socket_status(problem), proc.stderr
    assert proc.stdout == ""
    assert names in proc.stderr and "share" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("problem", SHARE_SOCKET_PROBLEMS)
def test_share_socket_problems_are_found_before_any_populate(
    tmp_path: os.PathLike[str], problem: str
) -> None:
    with _share_socket_problem(tmp_path, problem) as (path, names):
        proc = hostpool("serve", "--port", "0", "--pool", "kv=1MiB", "--share-socket", path,
                        importtime=True)  # fmt: skip
    assert proc.returncode == _share_socket_status(problem), proc.stderr
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert len(said) == 1 and names in said[0], said
    assert not imported_torch(proc.stderr)  # refused before torch, let alone a page
    assert log_events(proc.stderr) == []
