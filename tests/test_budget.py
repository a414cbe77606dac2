"""Admission: refused before any mmap, with the need and the limit named."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from hostpool import AllocationError, HostPoolManager
from hostpool.memory import kernel
from tests import helpers

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nothing_mapped_since(fds: dict[int, str], maps: int) -> None:
    assert helpers.fd_links() == fds
    assert len(helpers.maps_lines("hostpool.")) == maps


def test_over_ram_is_refused_before_mmap() -> None:
    fds, maps = helpers.fd_links(), len(helpers.maps_lines("hostpool."))
    available = kernel.meminfo()["MemAvailable"]
    with HostPoolManager() as manager:
        alloc = manager.allocator("ram")
        with pytest.raises(AllocationError) as exc:
            alloc.allocate((available + (1 << 30),), torch.uint8)
    assert exc.value.reason == "budget"
    message = str(exc.value)
    assert f"need {available + (1 << 30)} bytes" in message and "MemAvailable" in message
    _nothing_mapped_since(fds, maps)


def test_over_explicit_budget() -> None:
    fds, maps = helpers.fd_links(), len(helpers.maps_lines("hostpool."))
    with HostPoolManager(budget=8 * MiB) as manager:
        alloc = manager.allocator("small")
        t = alloc.allocate((6 * MiB,), torch.uint8)
        with pytest.raises(AllocationError) as exc:
            alloc.allocate((4 * MiB,), torch.uint8)
        assert "need 4194304 bytes" in str(exc.value) and "budget 8388608 bytes" in str(exc.value)
        assert manager.budget_bytes == 8 * MiB
        assert manager.budget_reserved_bytes == 6 * MiB
        alloc.release(t)
        del t
        t = alloc.allocate((4 * MiB,), torch.uint8)  # released bytes are available again
        alloc.close()
        del t
    _nothing_mapped_since(fds, maps)


def test_over_hugetlb_pool(hugepages_2m: int) -> None:
    free = kernel.hugepage_pool(2 * MiB)
    assert free is not None
    fds, maps = helpers.fd_links(), len(helpers.maps_lines("hostpool."))
    with HostPoolManager() as manager:
        alloc = manager.allocator("hugebudget", hugepages="required")
        with pytest.raises(AllocationError) as exc:
            alloc.allocate(((free.available + 2) * 2 * MiB,), torch.uint8)
    message = str(exc.value)
    assert f"need {free.available + 2} pages of 2MiB" in message
    assert f"{free.available} free" in message
    _nothing_mapped_since(fds, maps)


def test_hugetlb_is_not_refused_for_ram_the_pool_already_took(hugepages_2m: int) -> None:
    # A headroom as large as MemAvailable leaves no room for normal pages at all.
    headroom = kernel.meminfo()["MemAvailable"]
    with HostPoolManager(headroom=headroom) as manager:
        with pytest.raises(AllocationError, match="MemAvailable"):
            manager.allocator("normal").allocate((4 * MiB,), torch.uint8)
        huge = manager.allocator("huge", hugepages="required")
        t = huge.allocate((4 * MiB,), torch.uint8)
        assert huge.regions[0].page_size == 2 * MiB
        huge.close()
        del t


def test_eight_threads_never_overshoot_a_budget() -> None:
    budget = 64 * MiB
    with HostPoolManager(budget=budget) as manager:
        allocs = [manager.allocator(f"race{i}", "mmap", populate="none") for i in range(4)]
        kept: list[torch.Tensor] = []
        refused = []
        lock = threading.Lock()

        def grab(i: int) -> None:
            while True:
                try:
                    t = allocs[i % 4].allocate((3 * MiB,), torch.uint8)
                except AllocationError as exc:
                    refused.append(exc.reason)
                    return
                with lock:
                    kept.append(t)

        threads = [threading.Thread(target=grab, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        held = sum(r.mapped_bytes for r in manager.snapshot())
        assert held <= budget
        assert len(kept) == budget // (3 * MiB)
        assert refused == ["budget"] * 8
        kept.clear()


def test_over_a_cgroup_v1_memory_limit(root: None) -> None:
    own = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if "memory" in controllers.split(","):
                own = path
    base = f"/sys/fs/cgroup/memory{own}" if own is not None else None
    if base is None or not os.path.isdir(base):
        pytest.skip("no cgroup v1 memory controller here")
    group = os.path.join(base, f"hostpool-test-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(512 * MiB))
        proc = helpers.run_python(
            f"""
            import os, torch
            with open({os.path.join(group, "cgroup.procs")!r}, "w") as f:
                f.write(str(os.getpid()))
            from hostpool import HostPoolManager, AllocationError
            from tests import helpers
            with HostPoolManager() as m:
                try:
                    m.allocator("cg").allocate((1 << 30,), torch.uint8)
                except AllocationError as e:
                    print("refused:", e)
                assert helpers.fd_links() == {{}}
            """,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr
        assert "refused:" in proc.stdout
        assert "memory.limit_in_bytes" in proc.stdout and "need 1073741824 bytes" in proc.stdout
        assert "limit 536870912 bytes" in proc.stdout
    finally:
        os.rmdir(group)


def test_collected_and_shared_bytes_come_back_to_the_budget() -> None:
    import gc

    with HostPoolManager(budget=8 * MiB) as manager:
        alloc = manager.allocator("gcbudget")
        t = alloc.allocate((6 * MiB,), torch.uint8)
        assert manager.budget_reserved_bytes == 6 * MiB
        del t
        gc.collect()  # the finalizer releases it: held bytes follow
        assert manager.budget_reserved_bytes == 0
        t = alloc.allocate((6 * MiB,), torch.uint8)
        alloc.close()
        del t
