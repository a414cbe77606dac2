"""The metrics route of the vLLM integration without vLLM: worker processes publish their
ledger, the collector in their ancestor (vLLM's API server in real life; this test process
here) serves the contract's series summed over its live descendants only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hostpool.errors import ConfigError
from hostpool.integrations.vllm import metrics_route

WORKER = """
import sys, torch
from hostpool import HostPoolManager
from hostpool.integrations.vllm import metrics_route
directory, pool, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
manager = HostPoolManager()
tensor = manager.allocator(pool, "shm").allocate((size,), torch.int8)
metrics_route.worker_region_made({"hostpool_metrics_dir": directory})
print("ready", flush=True)
sys.stdin.readline()  # "release"
allocator = manager.allocator(pool, "shm")
allocator.release(tensor)
del tensor
manager.close()
metrics_route.worker_region_released()
print("released", flush=True)
sys.stdin.readline()  # "exit"
"""


class Worker:
    def __init__(self, directory: Path, pool: str, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(directory), pool, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.expect("ready")

    def expect(self, line: str) -> None:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().strip()
        assert got == line, (got, self.proc.poll())

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    d = tmp_path / "metrics"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def workers(directory: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


def scrape(directory: Path) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry()
    registry.register(metrics_route.VllmWorkersCollector(directory))
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_pool(samples: dict[tuple[tuple[str, str], ...], float], pool: str) -> float:
    return sum(v for labels, v in samples.items() if ("pool", pool) in labels)


def test_descendant_workers_are_summed_and_a_released_one_vanishes(
    directory: Path, workers: list[Worker]
) -> None:
    workers.append(Worker(directory, "vllm_offload", 3 << 20))
    workers.append(Worker(directory, "vllm_offload", 5 << 20))
    workers.append(Worker(directory, "other", 1 << 20))
    # A file of a process that is not ours (pid 1) is never read.
    (directory / "1.json").write_text(
        json.dumps(
            {
                "pid": 1,
                "samples": {
                    "hostpool_allocated_bytes": [[["vllm_offload", "shm", "4KiB"], 1e12]],
                },
            }
        )
    )
    got = scrape(directory)
    allocated = got["hostpool_allocated_bytes"]
    assert by_pool(allocated, "vllm_offload") == float(8 << 20)
    assert by_pool(allocated, "other") == float(1 << 20)
    assert by_pool(got["hostpool_open_fds"], "vllm_offload") == 4.0  # 2 workers x (fd + dup)
    assert by_pool(got["hostpool_live_allocations"], "vllm_offload") == 2.0
    assert by_pool(got["hostpool_allocations_total"], "vllm_offload") == 2.0
    # Host-wide and per-process values are not summed: one build_info of 1.
    assert list(got["hostpool_build_info"].values()) == [1.0]
    assert all("pid" not in dict(labels) for s in got.values() for labels in s)

    workers[0].send("release")
    workers[0].expect("released")
    assert not (directory / f"{workers[0].proc.pid}.json").exists()
    got = scrape(directory)
    assert by_pool(got["hostpool_allocated_bytes"], "vllm_offload") == float(5 << 20)
    # The released worker's explicit release left with its file (the process is going
    # away); what remains never shows a finalizer release.
    assert (
        by_pool(
            {k: v for k, v in got["hostpool_releases_total"].items() if ("how", "finalizer") in k},
            "vllm_offload",
        )
        == 0.0
    )

    # A worker that dies without releasing (SIGKILL) stops counting at once.
    workers[1].proc.kill()
    workers[1].proc.wait(timeout=60)
    got = scrape(directory)
    assert by_pool(got.get("hostpool_allocated_bytes", {}), "vllm_offload") == 0.0
    assert by_pool(got["hostpool_allocated_bytes"], "other") == float(1 << 20)


def test_no_workers_no_series(directory: Path) -> None:
    assert scrape(directory) == {}


def test_files_of_dead_workers_are_pruned_live_strangers_kept(directory: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)  # reaped: its pid no longer exists
    body = json.dumps({"pid": gone.pid, "samples": {}})
    (directory / f"{gone.pid}.json").write_text(body)
    (directory / "1.json").write_text(json.dumps({"pid": 1, "samples": {}}))
    (directory / "notes.txt").write_text("not ours")
    assert scrape(directory) == {}
    assert sorted(p.name for p in directory.iterdir()) == ["1.json", "notes.txt"]


def test_metrics_dir_must_be_private(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ConfigError, match="mode 0700"):
        metrics_route.metrics_dir({"hostpool_metrics_dir": str(shared)})
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        metrics_route.metrics_dir({"hostpool_metrics_dir": str(link)})
    made = metrics_route.metrics_dir({"hostpool_metrics_dir": str(tmp_path / "new")})
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
