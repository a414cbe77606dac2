"""The multiprocess publisher never stops, never fails an allocation, and restarts in a
forked child (issue 26 points 2, 5, 6). Each case runs in a fresh interpreter with
PROMETHEUS_MULTIPROC_DIR set, as sglang and vLLM workers run, and is read back from the
directory by prometheus_client's own MultiProcessCollector."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
DEADLINE = 120.0  # an upper bound on a busy 2-core host, never a pace


def _run(
    code: str, tmp_path: Path, *, timeout: float = DEADLINE
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": os.fspath(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _sample(path: Path, name: str, **labels: str) -> float | None:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.fspath(path))
    return registry.get_sample_value(name, labels)


def _last_line(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1].split()


def test_publisher_survives_fd_exhaustion_and_resumes(tmp_path: Path) -> None:
    """Point 2: one EMFILE killed the publishing thread for good. Here every publish fails
    while the process is out of fds (each counted, one log line), and the first publish
    after fds come back writes everything, the failure count included."""
    proc = _run(
        """
        import os, resource, torch, structlog
        from hostpool import HostPoolManager
        from hostpool.multiprocess import MultiprocessPublisher
        m = HostPoolManager()
        kept = m.allocator("mp_faulty", "mmap").allocate((1 << 20,), torch.uint8)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        publisher = MultiprocessPublisher(interval=0.02).start()  # must not raise
        assert publisher.wait_attempts(4, timeout=120), "the thread stopped publishing"
        assert publisher.successes == 0 and publisher.failures >= 4
        for fd in held:
            os.close(fd)
        assert publisher.wait_successes(1, timeout=120), "publishing did not resume"
        print("failures", publisher.failures, flush=True)
        """,
        tmp_path,
    )
    _, failures = _last_line(proc)
    assert int(failures) >= 4
    assert proc.stderr.count("hostpool.publish_failed") == 1, proc.stderr  # once per kind
    assert "fd_limit" in proc.stderr
    assert (
        _sample(
            tmp_path,
            "hostpool_allocated_bytes",
            pool="mp_faulty",
            allocator="mmap",
            page_size="4KiB",
        )
        == MiB
    )
    errors = _sample(tmp_path, "hostpool_publish_errors_total", kind="fd_limit")
    assert errors == int(failures)


def test_publishing_never_fails_an_allocation_through_the_sglang_integration(
    tmp_path: Path,
) -> None:
    """Point 4: with `register_metrics()` and PROMETHEUS_MULTIPROC_DIR, starting the
    publisher after sglang's `alloc_shm` raised DuplicateTimeseries into the allocation
    and leaked the caller's fd. The real sglang, patched by the integration."""
    proc = _run(
        """
        import os, torch
        from tests.sglang.cpu_import import load_sglang
        from hostpool.integrations import sglang as integration
        from hostpool.metrics import register_metrics
        load_sglang()
        integration.install()
        register_metrics()
        from sglang.srt.mem_cache.storage.mmap import alloc_shm
        def fds():
            # The publisher's own files in the multiprocess directory are not a leak.
            here = os.environ["PROMETHEUS_MULTIPROC_DIR"]
            out = set()
            for name in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{name}")
                except OSError:
                    continue
                if not target.startswith(here):
                    out.add((name, target))
            return out
        before = fds()
        tensor, fd, mm = alloc_shm((256, 1024), torch.float32)  # must not raise
        from hostpool.multiprocess import current_publisher
        publisher = current_publisher()
        assert publisher is not None and publisher.wait_successes(1, timeout=120)
        os.close(fd)
        mm.close()
        del tensor, mm
        import gc; gc.collect()
        print("leaked", len(fds() - before), flush=True)
        """,
        tmp_path,
    )
    _, leaked = _last_line(proc)
    assert int(leaked) == 0
    assert _sample(tmp_path, "hostpool_allocations_total", pool="default", allocator="shm") == 1


def test_publish_failures_at_start_never_reach_the_allocating_caller(tmp_path: Path) -> None:
    """Point 4: the multiprocess directory is not a directory (a real fault no uid can
    bypass): every allocation succeeds, the publisher keeps trying, errors are counted."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import torch
                from hostpool import alloc_shm
                from hostpool.metrics import publish_errors
                from hostpool.multiprocess import ensure_publisher
                for _ in range(3):
                    tensor, fd, mm = alloc_shm((4096,), torch.uint8, pool="mp_nodir")
                    publisher = ensure_publisher()  # what an integration calls: never raises
                    import os; os.close(fd); mm.close(); del tensor, mm
                assert publisher is not None
                assert publisher.wait_attempts(3, timeout=120)
                print("errors", sum(publish_errors().values()), flush=True)
                """
            ),
        ],
        cwd=ROOT,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": os.fspath(blocker)},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    _, errors = _last_line(proc)
    assert int(errors) >= 3
    assert proc.stderr.count("hostpool.publish_failed") == 1, proc.stderr


def test_publisher_restarts_in_a_forked_child(tmp_path: Path) -> None:
    """Point 5: a child forked after the parent's publisher started (vLLM forks its
    workers on CUDA) publishes its own regions: the fork hook starts its publisher."""
    proc = _run(
        """
        import os, torch
        from hostpool import HostPoolManager
        from hostpool.multiprocess import current_publisher, ensure_publisher
        m = HostPoolManager()
        kept = m.allocator("mp_parent", "mmap").allocate((1 << 20,), torch.uint8)
        parent = ensure_publisher(interval=0.02)
        assert parent is not None and parent.wait_successes(1, timeout=120)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(r)
                child_manager = HostPoolManager()
                child_kept = child_manager.allocator("mp_child", "mmap").allocate(
                    (2 << 20,), torch.uint8
                )
                publisher = current_publisher()  # never starts one: the fork hook did
                assert publisher is not None and publisher is not parent
                # A publish in flight as the region was recorded may end after this
                # read without it; the one after that began after the record.
                seen = publisher.successes
                assert publisher.wait_successes(seen + 2, timeout=120)
                os.write(w, b"published")
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        said = os.read(r, 64)
        _, status = os.waitpid(pid, 0)
        print("child", pid, os.waitstatus_to_exitcode(status), said.decode(), flush=True)
        """,
        tmp_path,
    )
    _, pid, code, said = _last_line(proc)
    assert (code, said) == ("0", "published"), proc.stderr
    assert (tmp_path / f"gauge_livesum_{pid}.db").exists()
    labels = {"allocator": "mmap", "page_size": "4KiB"}
    assert _sample(tmp_path, "hostpool_allocated_bytes", pool="mp_child", **labels) == 2 * MiB
    # The child owns none of the parent's regions: only the parent's file counts them.
    assert _sample(tmp_path, "hostpool_allocated_bytes", pool="mp_parent", **labels) == MiB


@pytest.mark.parametrize("with_collector", [False, True])
def test_publisher_beside_a_registered_collector(tmp_path: Path, with_collector: bool) -> None:
    """The publisher registers nothing in prometheus_client's global registry, so a
    collector registered with `register_metrics()` never collides with it."""
    proc = _run(
        f"""
        import torch
        from hostpool import HostPoolManager
        from hostpool.metrics import register_metrics
        from hostpool.multiprocess import MultiprocessPublisher
        if {with_collector}:
            register_metrics()
        manager = HostPoolManager()
        kept = manager.allocator("mp_both", "mmap").allocate((4096,), torch.uint8)
        publisher = MultiprocessPublisher(interval=3600).start()
        print("ok", publisher.successes, flush=True)
        """,
        tmp_path,
    )
    assert _last_line(proc) == ["ok", "1"]
    assert _sample(tmp_path, "hostpool_live_allocations", pool="mp_both", allocator="mmap") == 1
