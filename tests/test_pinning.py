"""CUDA pinning through the runtime seam, with a fake runtime that can fail at chunk k."""

from __future__ import annotations

import gc

import pytest
import torch

from hostpool import AllocationError, HostPoolManager, ShmHostTensorAllocator
from hostpool.memory import cuda
from tests import helpers

MiB = 1 << 20


def test_failure_at_chunk_k_rolls_back_in_reverse(
    fake_cuda: helpers.FakeCuda, no_leaked_fds: None
) -> None:
    fake_cuda.fail_at = 3
    alloc = ShmHostTensorAllocator("pin", pin=True, pin_chunk_bytes=MiB)
    with pytest.raises(AllocationError, match="cudaHostRegister"):
        alloc.allocate((8 * MiB,), torch.uint8)
    registered = [a for op, a in fake_cuda.log if op == "register"]
    unregistered = [a for op, a in fake_cuda.log if op == "unregister"]
    assert len(registered) == 3
    assert unregistered == registered[::-1]
    assert fake_cuda.registered == {}
    assert fake_cuda.problems == []
    assert alloc.regions == []


def test_chunks_are_page_aligned_and_recorded(fake_cuda: helpers.FakeCuda) -> None:
    with HostPoolManager() as manager:
        alloc = manager.allocator("pinned", pin=True, pin_chunk_bytes=3 * MiB + 5)
        t = alloc.allocate((10 * MiB,), torch.uint8)
        chunks = sorted(fake_cuda.registered.items())
        assert [n for _, n in chunks] == [3 * MiB, 3 * MiB, 3 * MiB, MiB]
        assert all(a % 4096 == 0 for a, _ in chunks)
        (record,) = manager.snapshot()
        assert record.pinned_bytes == 10 * MiB
        alloc.close()
        del t
    assert fake_cuda.registered == {}
    assert fake_cuda.problems == []


def test_dropped_pinned_region_is_unregistered_before_unmap(fake_cuda: helpers.FakeCuda) -> None:
    alloc = ShmHostTensorAllocator("pingc", pin=True, pin_chunk_bytes=2 * MiB)
    t = alloc.allocate((4 * MiB,), torch.uint8)
    view = t[:10]
    assert len(fake_cuda.registered) == 2
    del t
    gc.collect()
    assert len(fake_cuda.registered) == 2  # a view still uses the pages
    del view
    gc.collect()
    assert fake_cuda.registered == {}
    assert fake_cuda.problems == []  # the fake checked /proc/self/maps at each unregister


class NoCuda(helpers.FakeCuda):
    """A runtime without CUDA, whatever the machine has (a GPU runner included)."""

    def available(self) -> bool:
        return False


def test_pin_without_cuda_is_a_noop(no_leaked_fds: None) -> None:
    runtime = NoCuda()
    previous = cuda.set_runtime(runtime)
    try:
        alloc = ShmHostTensorAllocator("nocuda", pin=True)
        t = alloc.allocate((MiB,), torch.uint8)
        assert alloc.regions[0].pinned_bytes == 0
        assert runtime.attempts == 0 and runtime.log == []
        alloc.close()
        del t
    finally:
        cuda.set_runtime(previous)
