"""Admission: refused before any mmap, with the need and the limit named."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hostpool import AllocationError, HostPoolManager, ShmHostTensorAllocator
from hostpool.memory import kernel
from tests import helpers, memory_support

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
        assert huge.regions[0].facts.page_size == 2 * MiB
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
    with helpers.memory_cgroup("hostpool-test", 512 * MiB) as group:
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


def _race(alloc: Any, threads: int) -> tuple[list[torch.Tensor], list[str]]:
    """`threads` threads each ask for 1 MiB at once; what was admitted and refused."""
    barrier = threading.Barrier(threads)
    kept: list[torch.Tensor] = []
    refused: list[str] = []
    lock = threading.Lock()

    def grab() -> None:
        barrier.wait()
        try:
            t = alloc.allocate((MiB,), torch.uint8)
        except AllocationError as exc:
            with lock:
                refused.append(exc.reason)
            return
        with lock:
            kept.append(t)

    helpers.in_threads(grab, threads)
    return kept, refused


def test_exactly_as_many_as_fit_are_admitted() -> None:
    """16 threads x 1 MiB against 4 MiB, many rounds: 4 admitted every time (a region is
    never counted both held and in flight)."""
    rounds = 40
    with HostPoolManager(budget=4 * MiB) as manager:
        alloc = manager.allocator("exactfit", "mmap", populate="none")
        for _ in range(rounds):
            kept, refused = _race(alloc, 16)
            assert (len(kept), refused) == (4, ["budget"] * 12)
            while kept:
                alloc.release(kept.pop())  # the last view goes with it: unmapped now
        assert manager.budget_reserved_bytes == 0


def test_hugetlb_requests_are_held_to_the_explicit_budget(hugepages_2m: int) -> None:
    with HostPoolManager(budget=4 * MiB) as manager:
        alloc = manager.allocator("hugeexplicit", hugepages="prefer")
        with pytest.raises(AllocationError) as exc:
            alloc.allocate((8 * MiB,), torch.uint8)
        assert exc.value.reason == "budget" and "explicit budget" in str(exc.value)
        assert alloc.regions == []


def test_a_hugepage_fallback_is_admitted_like_any_request(hugepages_2m: int) -> None:
    """hugetlb refused (a hugetlb cgroup limit): `prefer` falls back to normal pages, and
    that fallback meets the budget too."""
    with memory_support.hugetlb_cgroup("hostpool-fallback", 0) as group:
        proc = helpers.run_python(
            f"""
            import os, torch
            with open({os.path.join(group, "cgroup.procs")!r}, "w") as f:
                f.write(str(os.getpid()))
            from hostpool import HostPoolManager, AllocationError
            from hostpool.core.ledger import get_ledger
            with HostPoolManager(budget=8 << 20) as m:
                a = m.allocator("fb", hugepages="prefer")
                try:
                    a.allocate((16 << 20,), torch.uint8)
                    print("over budget?!")
                except AllocationError as e:
                    print("refused", e.reason)
                t = a.allocate((4 << 20,), torch.uint8)
                facts = a.regions[0].facts
                print("page", facts.page_size, facts.hugepage_fallbacks)
                a.close()
                del t
            print("fallbacks", get_ledger().counters().fallbacks_total)
            """,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "refused budget" in proc.stdout
        assert "page 4096 ('hugetlb_pool_short'" in proc.stdout


def test_every_allocation_path_meets_the_cgroup_it_is_in_now(root: None) -> None:
    """Plain allocators, alloc_shm, and a manager whose process moved after its first
    allocation: 256 MiB inside a 128 MiB cgroup v1 limit is a typed error, not OOM."""
    with helpers.memory_cgroup("hostpool-plain", 128 * MiB) as group:
        proc = helpers.run_python(
            f"""
            import os, torch
            from hostpool import (AllocationError, HostPoolManager, ShmHostTensorAllocator,
                                  MmapHostTensorAllocator, alloc_shm)
            from tests import helpers
            m = HostPoolManager()
            kv = m.allocator("moved")
            first = kv.allocate((MiB := 1 << 20,), torch.uint8)  # before the move
            with open({os.path.join(group, "cgroup.procs")!r}, "w") as f:
                f.write(str(os.getpid()))
            big = (256 << 20,)
            for name, call in (
                ("shm", lambda: ShmHostTensorAllocator("cgplain").allocate(big, torch.uint8)),
                ("mmap", lambda: MmapHostTensorAllocator("cgplain").allocate(big, torch.uint8)),
                ("alloc_shm", lambda: alloc_shm(big, torch.uint8, pool="cgplain")),
                ("manager", lambda: kv.allocate(big, torch.uint8)),
            ):
                try:
                    call()
                    print(name, "allocated?!")
                except AllocationError as e:
                    print(name, e.reason, "memory.limit_in_bytes" in str(e))
            m.close()
            del first
            assert helpers.fd_links() == {{}}
            """,
            cwd=ROOT,
        )
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        lines = proc.stdout.split("\\n")
        for expected in (
            "shm no_memory True",
            "mmap no_memory True",
            "alloc_shm no_memory True",
            "manager budget True",
        ):
            assert expected in proc.stdout, (expected, lines)


def test_no_free_fds_is_fd_limit_counted_never_a_raw_oserror() -> None:
    proc = helpers.run_python(
        """
        import os, resource, torch
        from hostpool import AllocationError, HostPoolManager
        from hostpool.core.ledger import get_ledger
        m = HostPoolManager()
        a = m.allocator("nofds")
        a.release(a.allocate((4096,), torch.uint8))  # warm: imports and probes
        highest = max(int(n) for n in os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
        fillers = []
        try:
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass  # every number below the limit is taken now
        for what, call in (
            ("alloc", lambda: a.allocate((4096,), torch.uint8)),
            ("new", lambda: HostPoolManager().allocator("nofds").allocate((4096,), torch.uint8)),
        ):
            try:
                call()
                print(what, "allocated?!")
            except AllocationError as e:
                print(what, e.reason)
        for fd in fillers:
            os.close(fd)
        print("counted", get_ledger().counters().failures_total.get(("nofds", "fd_limit"), 0))
        """,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alloc fd_limit" in proc.stdout and "new fd_limit" in proc.stdout
    assert "counted 2" in proc.stdout


def test_a_full_tmpfs_under_populate_auto_is_no_space(root: None, tmp_path: Path) -> None:
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=4m tmpfs {mnt}") != 0:
        pytest.skip("cannot mount tmpfs")
    try:
        fds, maps = helpers.fd_links(), len(helpers.maps_lines("hostpool."))
        alloc = ShmHostTensorAllocator("fulltmpfs", shm_backend="devshm", fallback_dir=str(mnt))
        with pytest.raises(AllocationError) as exc:
            alloc.allocate((16 * MiB,), torch.uint8)  # populate="auto": MADV, EFAULT
        assert exc.value.reason == "no_space", str(exc.value)
        assert "tmpfs" in str(exc.value)
        _nothing_mapped_since(fds, maps)
        assert os.listdir(mnt) == []
    finally:
        os.system(f"umount {mnt}")


def test_a_refusal_carries_its_figures() -> None:
    """need, available and limit as attributes (as psutil's errors carry pid and name), the
    pool filled in by the allocator; the message still says the same."""
    with HostPoolManager(budget=8 * MiB) as manager:
        alloc = manager.allocator("figures", "mmap")
        kept = alloc.allocate((3 * MiB,), torch.uint8)
        with pytest.raises(AllocationError) as caught:
            alloc.allocate((6 * MiB,), torch.uint8)
        del kept
    error = caught.value
    assert (error.reason, error.pool) == ("budget", "figures")
    assert (error.need_bytes, error.limit_bytes) == (6 * MiB, 8 * MiB)
    assert error.available_bytes == 8 * MiB - 3 * MiB
    assert f"need {6 * MiB} bytes" in str(error)


def test_an_oserror_becomes_a_typed_failure_with_its_figures() -> None:
    import errno

    from hostpool.memory.kernel import failure_from_oserror

    space = failure_from_oserror(OSError(errno.ENOSPC, "full"), "sizing", 5 * MiB)
    assert (space.reason, space.need_bytes, space.available_bytes) == ("no_space", 5 * MiB, None)
    memory = failure_from_oserror(OSError(errno.ENOMEM, "short"), "populating", MiB)
    assert memory.reason == "no_memory" and memory.need_bytes == MiB
    assert memory.available_bytes is not None and f"MemAvailable {memory.available_bytes}" in str(
        memory
    )
    fds = failure_from_oserror(OSError(errno.EMFILE, "fds"), "dup", MiB)
    assert (fds.reason, fds.limit_bytes) == ("fd_limit", None)
