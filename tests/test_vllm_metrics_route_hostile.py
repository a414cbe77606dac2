"""The vLLM metrics route reads only what it wrote, and never fails vLLM (issue 36, points
2 and 3). Without vLLM: the reader is `VllmWorkersCollector` in this process (the API
server's place), the workers are real child processes, the odd files are real (a FIFO, a
300 MiB sparse file, a name `str.isdigit()` takes for a pid, a reused pid)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hostpool.integrations.vllm import metrics_files, metrics_route
from tests import waiting

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    d = tmp_path / "metrics"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Live child processes (descendants of this one, as workers are of vLLM's server)."""
    made: list[subprocess.Popen[str]] = []

    def spawn() -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True
        )
        made.append(proc)
        return proc

    yield spawn  # type: ignore[misc]
    for proc in made:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=waiting.DEADLINE)


def scrape(collector: metrics_route.VllmWorkersCollector) -> dict[str, dict[str, float]]:
    """{sample name: {"label=value,...": value}} of one scrape, in a thread joined
    with a deadline (a reader that blocks on a FIFO fails the test, not the run)."""
    registry = CollectorRegistry()
    registry.register(collector)
    out: list[bytes] = []
    thread = threading.Thread(target=lambda: out.append(generate_latest(registry)), daemon=True)
    thread.start()
    thread.join(waiting.DEADLINE)
    assert out, "the scrape blocked or raised"
    samples: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(out[0].decode()):
        for s in family.samples:
            key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples.setdefault(s.name, {})[key] = s.value
    return samples


def worker_file(pid: int, value: float, *, start: int | None = None) -> str:
    return json.dumps(
        {
            "pid": pid,
            "start": metrics_files.process_start(pid) if start is None else start,
            "samples": {"hostpool_allocated_bytes": [[["kv", "shm", "4KiB"], value]]},
        }
    )


def test_odd_files_are_skipped_and_counted(directory: Path, children: Any) -> None:
    good, fifo, big, shapeless, reused = (children() for _ in range(5))
    (directory / f"{good.pid}.json").write_text(worker_file(good.pid, 4096))
    os.mkfifo(directory / f"{fifo.pid}.json")  # an open for reading would block
    with open(directory / f"{big.pid}.json", "wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MiB that hold no pages
    (directory / f"{shapeless.pid}.json").write_text(
        json.dumps({"pid": shapeless.pid, "start": metrics_files.process_start(shapeless.pid),
                    "samples": {"hostpool_allocated_bytes": [[["kv"], "lots"]]}})
    )  # fmt: skip
    # A file left by an earlier process with this pid (its start time differs).
    start = metrics_files.process_start(reused.pid)
    assert start is not None
    (directory / f"{reused.pid}.json").write_text(worker_file(reused.pid, 1e12, start=start - 1))
    (directory / "\u00b2.json").write_text("{}")  # '²'.isdigit() is True; not a pid
    collector = metrics_route.VllmWorkersCollector(directory)
    with structlog.testing.capture_logs() as logs:
        got = scrape(collector)
        again = scrape(collector)
    # only the good one is summed
    assert got["hostpool_allocated_bytes"] == {"allocator=shm,page_size=4KiB,pool=kv": 4096.0}
    skipped = again["hostpool_vllm_route_skipped_files_total"]
    for reason in ("name", "not_regular", "too_large", "malformed", "stale_pid"):
        assert skipped[f"reason={reason}"] == 2.0, (reason, skipped)  # once per scrape
    warned = [e["reason"] for e in logs if e["event"] == "hostpool.vllm_metrics_file_skipped"]
    assert sorted(warned) == ["malformed", "name", "not_regular", "stale_pid", "too_large"]
    # Nothing of theirs was removed: their pids are alive.
    assert len(os.listdir(directory)) == 6


def test_files_of_dead_workers_go_with_their_temporary_files(directory: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=waiting.DEADLINE)  # reaped: its pid no longer exists
    for name in (f"{gone.pid}.json", f"{gone.pid}.140213.tmp"):
        (directory / name).write_text("{}")
    (directory / f"{os.getpid()}.140213.tmp").write_text("{}")  # a live writer's: kept
    assert metrics_route.prune_dead(directory) == [gone.pid]
    assert os.listdir(directory) == [f"{os.getpid()}.140213.tmp"]


def test_a_file_of_another_uid_is_skipped(directory: Path, children: Any) -> None:
    worker = children()
    path = directory / f"{worker.pid}.json"
    path.write_text(worker_file(worker.pid, 4096))
    os.chown(path, 65534, 65534)
    got = scrape(metrics_route.VllmWorkersCollector(directory))
    assert "hostpool_allocated_bytes" not in got
    assert got["hostpool_vllm_route_skipped_files_total"]["reason=owner"] == 1.0


def test_a_missing_directory_fails_no_scrape(tmp_path: Path) -> None:
    collector = metrics_route.VllmWorkersCollector(tmp_path / "gone")
    with structlog.testing.capture_logs() as logs:
        assert scrape(collector) == {}
        assert scrape(collector) == {}
    assert [e["event"] for e in logs] == ["hostpool.vllm_metrics_scrape_failed"]


# -- the worker side ----------------------------------------------------------------------
FORKED = textwrap.dedent(
    """
    import json, os, sys
    from hostpool.integrations.vllm import metrics_route
    directory = sys.argv[1]
    config = {"hostpool_metrics_dir": directory}
    metrics_route.worker_region_made(config)
    mine = os.path.join(directory, f"{os.getpid()}.json")
    child = os.fork()
    if child == 0:
        # The child inherited the publisher object: releasing "its" region must neither
        # remove nor rewrite the parent's file.
        metrics_route.worker_region_released()
        metrics_route.worker_region_released()
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert status == 0, status
    # (the parent's own thread may have republished it meanwhile: same pid in it)
    assert os.path.exists(mine), "the child removed the parent's file"
    assert json.load(open(mine))["pid"] == os.getpid(), "the child wrote the parent's file"
    assert sorted(os.listdir(directory)) == [f"{os.getpid()}.json"], os.listdir(directory)
    metrics_route.worker_region_released()
    assert os.listdir(directory) == []
    print("ok")
    """
)


def test_a_forked_worker_leaves_its_parents_file_alone(directory: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORKED, str(directory)],
        capture_output=True,
        text=True,
        timeout=waiting.DEADLINE,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


@pytest.fixture
def route_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's route state, restored after the test."""
    monkeypatch.setattr(metrics_route, "_disabled", set())
    monkeypatch.setattr(metrics_route, "_publisher", None)
    yield
    assert metrics_route._publisher is None, "the test left a publisher running"


def test_a_release_racing_a_new_region_keeps_the_new_file(
    directory: Path, route_state: None
) -> None:
    config = {"hostpool_metrics_dir": str(directory)}
    path = directory / f"{os.getpid()}.json"
    metrics_route.worker_region_made(config)
    publisher = metrics_route._publisher
    assert publisher is not None
    made_started, made_done = threading.Event(), threading.Event()
    join = publisher.thread.join

    def slow_join(timeout: float | None = None) -> None:
        # The release is between "no publisher" and removing the file: a new region
        # comes now. Its file must survive (the bound only ends the wait if it cannot come).
        made_started.set()
        made_done.wait(2.0)
        join(timeout)

    publisher.thread.join = slow_join  # type: ignore[method-assign]

    def new_region() -> None:
        made_started.wait(waiting.DEADLINE)
        metrics_route.worker_region_made(config)
        made_done.set()

    racer = threading.Thread(target=new_region)
    racer.start()
    metrics_route.worker_region_released()
    racer.join(waiting.DEADLINE)
    assert path.exists(), "the release removed the new region's file"
    assert json.loads(path.read_text())["pid"] == os.getpid()
    metrics_route.worker_region_released()
    assert not path.exists()


def test_a_squatted_default_directory_disables_the_route_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, route_state: None
) -> None:
    parent = Path(tempfile.mkdtemp(prefix="hostpool-squat-"))
    try:
        parent.chmod(0o1777)  # like /tmp
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        monkeypatch.setattr(tempfile, "tempdir", str(parent))
        squatted = parent / f"hostpool-vllm-{os.getuid()}"
        subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             "mkdir", "-m", "0777", str(squatted)],
            check=True, timeout=waiting.DEADLINE,
        )  # fmt: skip
        with structlog.testing.capture_logs() as logs:
            metrics_route.worker_region_made({})  # get_worker goes on
            metrics_route.worker_region_made({})
            metrics_route.worker_region_released()
            metrics_route.worker_region_released()
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert [e["event"] for e in warnings] == ["hostpool.vllm_metrics_disabled"]
        assert "uid 65534" in warnings[0]["error"]
        assert os.listdir(squatted) == []  # nothing written into someone else's directory
    finally:
        shutil.rmtree(parent)
