"""`hostpool serve` answers while it populates, says when it is ready, stops cleanly, and
refuses a /dev/shm-style directory that cannot hold its pools before allocating."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import helpers, waiting
from tests.test_serve import Served, hostpool, imported_torch

BIG = 4 << 30  # one chunk: populate reports each 64 MiB span of it


def start(tmp_path: Path, config: str) -> tuple[Served, str]:
    """A serve process and its base URL, as soon as it listens (before populate ends)."""
    path = tmp_path / "serve.toml"
    path.write_text(config)
    err = os.fspath(tmp_path / "serve.err")
    proc, url = helpers.start_hostpool(
        err, "serve", "--port", "0", "--config", os.fspath(path),
        url=r'"url": "(http://[^"]+)/"', until='"hostpool.listening"',
    )  # fmt: skip
    return Served(proc, url, err), url


@pytest.fixture
def big(tmp_path: Path) -> Iterator[Served]:
    served, _ = start(tmp_path, f"[pools.kv]\nsize = {BIG}\nchunk = {BIG}\n")
    yield served
    served.kill()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def test_probes_answer_while_populating_then_ready(big: Served) -> None:
    populating = []
    # (hostpool_serve_ready, populated bytes) per scrape while /readyz said 503: serve
    # may turn ready between a /readyz answer and the next scrape, never back.
    scraped: list[tuple[float, float]] = []
    while True:
        status, body = big.get("/readyz")
        if status == 200:
            break
        # "starting": every pool populated, the share socket and demo not yet started
        assert status == 503 and (body.startswith("populating kv: ") or body == "starting\n")
        if body != "starting\n":
            populating.append(body)
        # while populating: alive, scrapeable, and the debug document is served
        assert big.get("/healthz") == (200, "ok\n")
        code, metrics = big.get("/metrics")
        assert code == 200
        target = 'hostpool_serve_populate_target_bytes{pool="kv"}'
        assert metric(metrics, target) == BIG
        done = metric(metrics, 'hostpool_serve_populate_done_bytes{pool="kv"}')
        assert 0 <= done <= BIG
        scraped.append((metric(metrics, "hostpool_serve_ready"), done))
        code, debug = big.get("/debug/pools")
        assert code == 200 and "kv" in json.loads(debug)["pools"]
    assert scraped and scraped[0][0] == 0, scraped[:3]  # 4 GiB is not instant
    assert scraped == sorted(scraped), scraped  # ready and populated bytes never go back
    assert all(done == BIG for ready, done in scraped if ready == 1), scraped
    assert body == "ready\n"
    assert populating, "never saw /readyz while populating"  # 4 GiB is not instant
    assert re.fullmatch(r"populating kv: \S+ of 4GiB\n", populating[-1]), populating[-1]
    _, metrics = big.get("/metrics")
    assert metric(metrics, "hostpool_serve_ready") == 1
    assert metric(metrics, 'hostpool_serve_populate_done_bytes{pool="kv"}') == BIG
    assert "hostpool.serving" in big.log()
    status, landing = big.get("/")
    assert status == 200 and all(p in landing for p in ("/metrics", "/readyz", "/healthz"))
    assert big.stop() == 0


def test_sigterm_exits_0_logs_stopped_and_leaves_no_memfd(tmp_path: Path) -> None:
    served, _ = start(tmp_path, '[pools.kv]\nsize = "256MiB"\n')
    prefix = f"hostpool.kv.{served.proc.pid}."
    try:
        waiting.wait_for(lambda: served.get("/readyz")[0] == 200, "ready", alive=served.proc)
        assert waiting.shm_fd_blocks(served.proc.pid, prefix) == 256 << 20
        assert waiting.shm_holders(prefix) == [served.proc.pid]
        assert served.stop() == 0
    finally:
        served.kill()
    log = [json.loads(x) for x in served.log().splitlines() if x.startswith("{")]
    assert log[-1]["event"] == "hostpool.serve_stopped"
    assert all(e["level"] in ("debug", "info") for e in log), log
    assert waiting.shm_holders(prefix) == []


def test_a_failure_after_populate_is_logged_at_error_and_exits_1(tmp_path: Path) -> None:
    """The share socket's path is taken while serve populates (after preflight found it
    free): serve logs hostpool.serve_failed at error, releases its pools and exits 1."""
    path = os.fspath(tmp_path / "share.sock")
    served, _ = start(tmp_path, f'[server]\nshare_socket = "{path}"\n[pools.kv]\nsize = {BIG}\n')
    # Frozen until the socket is taken: the share server starts only after populate.
    served.proc.send_signal(signal.SIGSTOP)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        assert "hostpool.serving" not in served.log() and not os.path.exists(path)
        live.bind(path)
        live.listen()
        served.proc.send_signal(signal.SIGCONT)
        code = served.proc.wait(timeout=waiting.DEADLINE)
    finally:
        live.close()
        served.kill()
    assert code == 1
    log = [json.loads(x) for x in served.log().splitlines() if x.startswith("{")]
    failed = [e for e in log if e["event"] == "hostpool.serve_failed"]
    assert [e["level"] for e in failed] == ["error"] and "already listening" in failed[0]["error"]
    assert log[-1]["event"] == "hostpool.serve_stopped"
    assert waiting.shm_holders(f"hostpool.kv.{served.proc.pid}.") == []


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards (tests run as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "shm"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", where], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", where], check=True)


def devshm_config(tmp_path: Path, directory: Path, size: str) -> str:
    path = tmp_path / "devshm.toml"
    path.write_text(
        f'[pools.kv]\nsize = "{size}"\nshm_backend = "devshm"\nfallback_dir = "{directory}"\n'
    )
    return os.fspath(path)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    said = [x for x in proc.stderr.splitlines() if not x.startswith("import time:")]
    assert len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return said[0]


def test_check_refuses_a_devshm_directory_too_small(tmp_path: Path, tiny_tmpfs: Path) -> None:
    config = devshm_config(tmp_path, tiny_tmpfs, "4MiB")
    for args in (["--check"], ["--port", "0"]):  # serve itself refuses it the same way
        proc = hostpool("serve", *args, "--config", config, importtime=True)
        assert proc.returncode == 1 and proc.stdout == ""
        line = one_line(proc)
        assert f"need 4MiB in {tiny_tmpfs}, which has 1MiB free" in line, line
        assert not imported_torch(proc.stderr)
    fits = hostpool("serve", "--check", "--port", "0", "--config",
                    devshm_config(tmp_path, tiny_tmpfs, "512KiB"))  # fmt: skip
    assert fits.returncode == 0, fits.stderr


def test_check_refuses_a_read_only_devshm_directory(tmp_path: Path, tiny_tmpfs: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", tiny_tmpfs], check=True)
    config = devshm_config(tmp_path, tiny_tmpfs, "4KiB")
    for args in (["--check"], ["--port", "0"]):
        proc = hostpool("serve", *args, "--config", config)
        assert proc.returncode == 1
        assert f"in {tiny_tmpfs}, which is mounted read-only" in one_line(proc)


def test_shm_directory_check_follows_the_backend(tmp_path: Path, tiny_tmpfs: Path) -> None:
    """memfd pools never touch the directory; `auto` uses it only without memfd."""
    from hostpool.errors import AllocationError
    from hostpool.serve.config import pool_spec
    from hostpool.serve.preflight import check_shm_directories

    auto = pool_spec("kv", {"size": "4MiB", "fallback_dir": os.fspath(tiny_tmpfs)})
    check_shm_directories([auto], has_memfd=True)
    with pytest.raises(AllocationError, match="which has 1MiB free") as info:
        check_shm_directories([auto], has_memfd=False)
    assert info.value.reason == "no_space"
    assert (info.value.need_bytes, info.value.available_bytes) == (4 << 20, 1 << 20)
    # two pools that fit one by one but not together
    half = {"size": "768KiB", "shm_backend": "devshm", "fallback_dir": os.fspath(tiny_tmpfs)}
    check_shm_directories([pool_spec("a", half)])
    with pytest.raises(AllocationError, match=r"pools a 768KiB, b 768KiB .* need 1\.5MiB"):
        check_shm_directories([pool_spec("a", half), pool_spec("b", half)])
