"""Every populate mode, measured independently: st_blocks for fds, mincore for anon."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from hostpool import MmapHostTensorAllocator, ShmHostTensorAllocator
from hostpool.errors import AllocationError
from tests import helpers

SIZE = 8 << 20


@pytest.mark.parametrize("mode", ["auto", "madvise", "map_populate", "touch"])
def test_shm_modes_leave_every_page_resident(mode: str, no_leaked_fds: None) -> None:
    alloc = ShmHostTensorAllocator("pop", populate=mode)
    t = alloc.allocate((SIZE,), torch.uint8)
    region = alloc.regions[0]
    assert region.facts.populate_mode == ("madvise" if mode == "auto" else mode)
    assert os.fstat(alloc.fd).st_blocks * 512 == SIZE
    assert region.resident_bytes() == SIZE
    alloc.close()
    del t


@pytest.mark.parametrize("mode", ["auto", "madvise", "map_populate", "touch"])
def test_anon_modes_leave_every_page_resident(mode: str) -> None:
    alloc = MmapHostTensorAllocator("pop", populate=mode)
    t = alloc.allocate((SIZE,), torch.uint8)
    region = alloc.regions[0]
    assert region.facts.populate_mode == ("madvise" if mode == "auto" else mode)
    assert helpers.mincore_resident(region.facts.address, SIZE) == SIZE
    assert region.resident_bytes() == SIZE
    alloc.close()
    del t


def test_none_leaves_pages_unresident_until_touched(no_leaked_fds: None) -> None:
    shm_alloc = ShmHostTensorAllocator("lazy", populate="none")
    anon_alloc = MmapHostTensorAllocator("lazy", populate="none")
    ts = shm_alloc.allocate((SIZE,), torch.uint8)
    ta = anon_alloc.allocate((SIZE,), torch.uint8)
    assert os.fstat(shm_alloc.fd).st_blocks == 0
    anon = anon_alloc.regions[0]
    assert helpers.mincore_resident(anon.facts.address, SIZE) == 0
    ts[: 3 * 4096].fill_(1)
    ta[4096 * 10 : 4096 * 12].fill_(1)
    assert os.fstat(shm_alloc.fd).st_blocks * 512 == 3 * 4096
    assert helpers.mincore_resident(anon.facts.address, SIZE) == 2 * 4096
    assert anon.resident_bytes() == 2 * 4096
    assert shm_alloc.regions[0].facts.populate_mode == "none"
    shm_alloc.close()
    anon_alloc.close()
    del ts, ta


def test_auto_falls_back_where_madvise_is_unsupported(
    monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    helpers.no_madv_populate(monkeypatch)
    shm_alloc = ShmHostTensorAllocator("old")
    anon_alloc = MmapHostTensorAllocator("old")
    ts = shm_alloc.allocate((SIZE,), torch.uint8)
    ta = anon_alloc.allocate((SIZE,), torch.uint8)
    assert shm_alloc.regions[0].facts.populate_mode == "map_populate"  # fallocate + MAP_POPULATE
    assert anon_alloc.regions[0].facts.populate_mode == "touch"
    assert os.fstat(shm_alloc.fd).st_blocks * 512 == SIZE
    assert helpers.mincore_resident(anon_alloc.regions[0].facts.address, SIZE) == SIZE
    with pytest.raises(AllocationError, match="MADV_POPULATE_WRITE"):
        ShmHostTensorAllocator("old", populate="madvise").allocate((4096,), torch.uint8)
    shm_alloc.close()
    anon_alloc.close()
    del ts, ta


def test_efault_is_a_failure_not_a_fallback(
    monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    from hostpool.memory import syscalls

    real = syscalls.madvise
    calls = []

    def fake(address: int, length: int, advice: int) -> None:
        calls.append(length)
        if advice == syscalls.MADV_POPULATE_WRITE and length > 4096:
            raise OSError(errno.EFAULT, "injected shortage")
        real(address, length, advice)

    monkeypatch.setattr(syscalls, "madvise", fake)
    alloc = ShmHostTensorAllocator("short")
    with pytest.raises(AllocationError) as exc:
        alloc.allocate((SIZE,), torch.uint8)
    assert exc.value.reason == "no_memory"
    assert alloc.regions == []


def test_parallel_populate_shares_small_spans_among_threads(
    monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    from hostpool.memory import populate, syscalls

    spans: list[tuple[int, int]] = []
    lock = threading.Lock()
    real = syscalls.madvise

    def spy(address: int, length: int, advice: int) -> None:
        if advice == syscalls.MADV_POPULATE_WRITE:
            with lock:
                spans.append((length, threading.get_ident()))
        real(address, length, advice)

    monkeypatch.setattr(syscalls, "madvise", spy)
    monkeypatch.setattr(populate, "PARALLEL_THRESHOLD", 16 << 20)
    monkeypatch.setattr(populate, "SPAN", 4 << 20)
    alloc = ShmHostTensorAllocator("par", populate_threads=4)
    t = alloc.allocate((32 << 20,), torch.uint8)
    # one probe of a page, then eight 4 MiB spans spread over the threads
    assert sorted(n for n, _ in spans[1:]) == [4 << 20] * 8
    assert len({ident for _, ident in spans[1:]}) > 1
    assert os.fstat(alloc.fd).st_blocks * 512 == 32 << 20
    alloc.close()
    del t


def test_a_stalled_populate_thread_holds_one_span_not_its_share(
    monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    # The first span stalls (as a thread the scheduler parks does) until every other span
    # is done: with a fixed half per thread that never happens, with a shared queue the
    # other thread takes all the rest.
    from hostpool.memory import populate, syscalls

    total = 8
    done: list[int] = []
    rest_done = threading.Event()
    first: list[int] = []
    lock = threading.Lock()
    real = syscalls.madvise

    def spy(address: int, length: int, advice: int) -> None:
        if advice != syscalls.MADV_POPULATE_WRITE or length != 4 << 20:
            real(address, length, advice)
            return
        with lock:
            is_first = not first
            first.append(address)
        if is_first:
            rest_done.wait(10)
        real(address, length, advice)
        with lock:
            done.append(address)
            if len(done) == total - 1 and not rest_done.is_set():
                rest_done.set()

    monkeypatch.setattr(syscalls, "madvise", spy)
    monkeypatch.setattr(populate, "PARALLEL_THRESHOLD", 16 << 20)
    monkeypatch.setattr(populate, "SPAN", 4 << 20)
    alloc = ShmHostTensorAllocator("stall", populate_threads=2)
    t = alloc.allocate((total * 4 << 20,), torch.uint8)
    assert rest_done.is_set()  # set by the other thread, not by the 10 s timeout
    assert len(done) == total
    assert os.fstat(alloc.fd).st_blocks * 512 == total * 4 << 20
    alloc.close()
    del t


def test_numa_bind_before_populate(no_leaked_fds: None) -> None:
    from hostpool.memory import kernel

    node = kernel.numa_nodes()[0]
    for cls in (ShmHostTensorAllocator, MmapHostTensorAllocator):
        alloc = cls("numa", numa_node=node)
        t = alloc.allocate((4 << 20,), torch.uint8)
        region = alloc.regions[0]
        assert region.facts.numa_node == node and region.resident_bytes() == 4 << 20
        # /proc/self/numa_maps shows the bind policy on the mapping
        start = f"{region.facts.address:x} "
        with open("/proc/self/numa_maps") as f:
            line = next(x for x in f if x.startswith(start))
        assert f"bind:{node}" in line
        alloc.close()
        del t


def test_anonymous_regions_are_named_where_the_kernel_can() -> None:
    from hostpool.memory import syscalls

    probe = MmapHostTensorAllocator("named", populate="none")
    t = probe.allocate((4096,), torch.uint8)
    region = probe.regions[0]
    supported = syscalls.name_anonymous_mapping(region.facts.address, 4096, "hostpool.probe")
    if not supported:
        assert region.facts.name is None  # CONFIG_ANON_VMA_NAME is off: skipped quietly
        probe.close()
        del t
        pytest.skip("this kernel cannot name anonymous mappings (CONFIG_ANON_VMA_NAME)")
    probe.close()
    del t
    alloc = MmapHostTensorAllocator("named")
    t = alloc.allocate((4096,), torch.uint8)
    assert helpers.maps_lines(f"[anon:hostpool.named.{os.getpid()}]")
    alloc.close()
    del t
