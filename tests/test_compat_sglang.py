"""hostpool.compat.sglang: the behaviour sglang's own allocator tests expect
(test/registered/unit/mem_cache/test_mmap_allocator.py), rewritten as this project's
tests, and a miniature host pool written as sglang's memory_pool_host.py is, whose only
hostpool-specific lines are its imports."""

from __future__ import annotations

import abc
import contextlib
import functools
import gc
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
import torch

from hostpool.compat.sglang import (
    ALLOC_MEMORY_FUNCS,
    HostTensorAllocator,
    MmapHostTensorAllocator,
    ShmHostTensorAllocator,
    alloc_mmap,
    alloc_shm,
    alloc_with_host_register,
    get_allocator_from_storage,
    get_allocator_type,
    host_register_chunk_bytes,
)
from hostpool.errors import ConfigError, InvalidRequestError
from hostpool.lifecycle import get_ledger
from hostpool.memory import cuda
from hostpool.pools.layouts import MHALayout, Sizing
from hostpool.storage import HiCacheStorageConfig
from hostpool.storage.file import HiCacheFile
from tests import helpers

PREFIX = "sglang_host_pool_"
GiB = 1 << 30


def record_at(address: int) -> Any:
    """The ledger's record of the region starting at `address`."""
    (record,) = [r for r in get_ledger().snapshot() if r.address == address]
    return record


@pytest.fixture
def nothing_left() -> Iterator[None]:
    """No sglang-named fd or mapping may outlive the test."""
    before = helpers.fd_links(PREFIX)
    yield
    gc.collect()
    get_ledger().drain()
    assert helpers.fd_links(PREFIX) == before
    assert helpers.maps_lines(PREFIX) == []


# -- sglang's allocator cases ------------------------------------------------------------
def test_alloc_mmap(nothing_left: None) -> None:
    tensor = alloc_mmap((10, 1024), torch.float32)
    assert tensor.shape == (10, 1024) and tensor.dtype == torch.float32
    address = tensor.data_ptr()
    assert address > 0
    record = record_at(address)
    assert (record.kind, record.backend, record.allocator) == ("mmap", "anon", "mmap")
    tensor[9, 1023] = 7.0
    assert tensor[9, 1023].item() == 7.0
    del tensor
    gc.collect()
    assert not helpers.range_mapped(address, record.mapped_bytes)  # the tensor owned it


def test_alloc_shm(nothing_left: None) -> None:
    tensor, fd, mm = alloc_shm((10, 1024), torch.float32)
    assert tensor.shape == (10, 1024) and tensor.dtype == torch.float32
    assert tensor.data_ptr() > 0 and fd >= 0
    assert isinstance(mm, mmap.mmap)
    tensor[0, 0] = 42.0
    assert tensor[0, 0].item() == 42.0
    os.lseek(fd, 0, os.SEEK_SET)  # the caller's fd is open and valid
    assert os.fstat(fd).st_size >= 10 * 1024 * 4
    address, length = tensor.data_ptr(), record_at(tensor.data_ptr()).mapped_bytes
    mm.close()  # sglang's cleanup, while the tensor still lives
    os.close(fd)
    assert tensor[0, 0].item() == 42.0  # the pages stay with the view
    del tensor, mm
    gc.collect()
    assert not helpers.range_mapped(address, length)


def test_shm_allocator_fds_close_when_the_allocator_is_collected(nothing_left: None) -> None:
    allocator = ShmHostTensorAllocator()
    tensor = allocator.allocate((2, 512), torch.int32, "cpu")
    assert tensor.shape == (2, 512) and tensor.dtype == torch.int32
    assert allocator.dims == (2, 512) and allocator.dtype == torch.int32
    fd = allocator.fd
    assert fd is not None and fd >= 0
    inode = os.fstat(fd).st_ino
    tensor[1, 1] = 99
    del allocator
    gc.collect()
    with contextlib.suppress(OSError):  # closed; or, if reused at once, another file
        assert os.fstat(fd).st_ino != inode
    assert tensor[1, 1].item() == 99  # the mapping leaves with the last view, not before
    del tensor


def test_explicit_close_then_collection_is_harmless(nothing_left: None) -> None:
    allocator = ShmHostTensorAllocator()
    tensor = allocator.allocate((4,), torch.uint8)
    allocator.close()
    assert allocator.fd is None
    del allocator, tensor


def test_alloc_shm_is_an_unlinked_memfd_named_for_sglang(nothing_left: None) -> None:
    tensor, fd, mm = alloc_shm((4, 256), torch.float32)
    target = os.readlink(f"/proc/self/fd/{fd}")
    assert PREFIX in target and target.endswith(" (deleted)")
    assert re.search(rf"{PREFIX}default\.{os.getpid()}\.\d+ \(deleted\)$", target)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)]
    mm.close()
    os.close(fd)
    del tensor


def test_named_pools_keep_sglangs_prefix(nothing_left: None) -> None:
    tensor, fd, mm = alloc_shm((8,), torch.uint8, name="host pool #1")
    assert f"{PREFIX}host_pool__1." in os.readlink(f"/proc/self/fd/{fd}")
    mm.close()
    os.close(fd)
    del tensor


def test_alloc_shm_with_hugepages_preferred_still_succeeds(nothing_left: None) -> None:
    tensor, fd, mm = alloc_shm((2, 2), torch.float32, hugepages="prefer")
    assert tensor.shape == (2, 2)
    record = record_at(tensor.data_ptr())
    # Hugetlb if the host has free 2 MiB pages, else normal pages with the reason said.
    assert record.page_size == 2 << 20 or record.hugepage_fallbacks
    mm.close()
    os.close(fd)
    del tensor


@pytest.mark.parametrize(
    "cls", [HostTensorAllocator, MmapHostTensorAllocator, ShmHostTensorAllocator]
)
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("meta")])
def test_non_cpu_device_is_an_assertion_error(cls: type[HostTensorAllocator], device: Any) -> None:
    allocator = cls()
    with pytest.raises(AssertionError, match="only supports CPU allocations"):
        allocator.allocate((2, 2), torch.float32, device=device)
    assert allocator.regions == []


def test_bad_requests_keep_hostpools_typed_errors() -> None:
    with pytest.raises(InvalidRequestError, match="positive"):
        HostTensorAllocator().allocate((0, 2), torch.float32, "cpu")


# -- factories ---------------------------------------------------------------------------
def test_get_allocator_from_storage() -> None:
    assert type(get_allocator_from_storage("shm")) is ShmHostTensorAllocator
    assert type(get_allocator_from_storage("default")) is HostTensorAllocator
    assert type(get_allocator_from_storage("mmap")) is MmapHostTensorAllocator
    assert type(get_allocator_from_storage("file")) is HostTensorAllocator  # file declares default
    args = SimpleNamespace(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config='{"backend_name": "x", "allocator": "shm"}',
    )
    assert type(get_allocator_from_storage(args)) is ShmHostTensorAllocator


def test_unknown_allocator_types_fall_back_with_a_warning() -> None:
    with structlog.testing.capture_logs() as logs:
        allocator = get_allocator_from_storage("mooncake")
    assert type(allocator) is HostTensorAllocator
    (event,) = [e for e in logs if e["event"] == "hostpool.compat.unknown_allocator"]
    assert event["allocator_type"] == "mooncake" and event["fallback"] == "default"


def test_get_allocator_type_keeps_sglangs_rule() -> None:
    assert get_allocator_type(SimpleNamespace(hicache_storage_backend=None)) == "default"
    assert get_allocator_type({"hicache_storage_backend": "shm"}) == "shm"
    assert get_allocator_type({"hicache_storage_backend": "hf3fs"}) == "hf3fs"
    dynamic = {
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": '{"allocator": "shm"}',
    }
    assert get_allocator_type(dynamic) == "shm"
    with pytest.raises(ConfigError):  # sglang would silently say "dynamic"
        get_allocator_type({**dynamic, "hicache_storage_backend_extra_config": "{oops"})


def test_free_hugetlb_bytes_is_zero_without_hugepages() -> None:
    assert HostTensorAllocator().free_hugetlb_bytes() == 0
    assert ShmHostTensorAllocator().free_hugetlb_bytes() == 0


def test_register_chunk_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", raising=False)
    assert host_register_chunk_bytes() == GiB
    monkeypatch.setenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", "0")
    assert host_register_chunk_bytes() == GiB  # sglang's floor of 1 GiB
    monkeypatch.setenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", "4")
    assert host_register_chunk_bytes() == 4 * GiB
    # Whole pages *and* whole copy units, so no copy spans two registrations.
    chunk = host_register_chunk_bytes(3 * 4096 * 5, limit=GiB)
    assert chunk % (3 * 4096 * 5) == 0 and chunk <= GiB and chunk > GiB - 3 * 4096 * 5
    assert host_register_chunk_bytes(6000, limit=GiB) % 6000 == 0
    with pytest.raises(InvalidRequestError, match="exceeds the chunk limit"):
        host_register_chunk_bytes(2 * GiB, limit=GiB)
    with pytest.raises(InvalidRequestError, match="positive"):
        host_register_chunk_bytes(0)


# -- a miniature sglang host pool: only these imports name hostpool ------------------------
def synchronized(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return func(self, *args, **kwargs)

    return wrapper


class HostKVCache(abc.ABC):
    def __init__(
        self,
        device_pool: Any,
        host_to_device_ratio: float,
        host_size: int,
        page_size: int,
        layout: str,
        pin_memory: bool,
        device: str,
        allocator_type: str = "default",
    ) -> None:
        self.device_pool = device_pool
        self.page_size = page_size
        self.layout = layout
        self.pin_memory = pin_memory
        self.device = device
        self.allocator = get_allocator_from_storage(allocator_type)

        self.dtype = device_pool.store_dtype
        self.size_per_token = self.get_size_per_token()
        if host_size > 0:
            self.size = int(host_size * 1e9 // self.size_per_token)
        else:
            self.size = int(device_pool.size * host_to_device_ratio)
        # One page more than asked for, page aligned.
        self.page_num = self.size // self.page_size + 1
        self.size = self.page_num * self.page_size

        self.kv_buffer = self.init_kv_buffer()
        self.lock = threading.RLock()
        self.clear()

    @abc.abstractmethod
    def get_size_per_token(self) -> int: ...

    @abc.abstractmethod
    def init_kv_buffer(self) -> torch.Tensor: ...

    @synchronized
    def clear(self) -> None:
        self.free_slots = torch.arange(self.size, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self.free_slots)

    @synchronized
    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert need_size % self.page_size == 0, "need a whole number of pages"
        if need_size > self.available_size():
            return None
        picked = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return picked

    @synchronized
    def free(self, indices: torch.Tensor) -> int:
        self.free_slots = torch.cat([self.free_slots, indices])
        return len(indices)


class MHATokenToKVPoolHost(HostKVCache):
    def get_size_per_token(self) -> int:
        self.head_num = self.device_pool.head_num
        self.head_dim = self.device_pool.head_dim
        self.layer_num = self.device_pool.layer_num
        return int(self.head_dim * self.head_num * self.layer_num * self.dtype.itemsize * 2)

    def init_kv_buffer(self) -> torch.Tensor:
        dims: tuple[int, ...]
        if self.layout == "layer_first":
            dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            dims = (2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.token_stride_size = self.head_num * self.head_dim * self.dtype.itemsize
        alloc_func = ALLOC_MEMORY_FUNCS[self.device_pool.device]
        return alloc_func(
            dims,
            dtype=self.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
            allocator=self.allocator,
        )

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        else:
            page = self.kv_buffer[:, index // self.page_size]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))


DEVICE_POOL = SimpleNamespace(
    head_num=2, head_dim=64, layer_num=4, size=100, store_dtype=torch.bfloat16, device="cuda"
)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_miniature_pool_matches_hostpools_layouts(layout: str, nothing_left: None) -> None:
    pool = MHATokenToKVPoolHost(DEVICE_POOL, 2.0, 0, 16, layout, False, "cpu", "shm")
    assert isinstance(pool.allocator, ShmHostTensorAllocator)
    assert pool.size == (200 // 16 + 1) * 16
    sizing = Sizing(size=pool.size, page_num=pool.page_num, page_size=16)
    expected = MHALayout(4, 2, 64, torch.bfloat16).buffers(layout, sizing)[0].dims
    assert pool.kv_buffer.shape == expected
    assert PREFIX in os.readlink(f"/proc/self/fd/{pool.allocator.fd}")
    del pool


def test_miniature_pool_pages_through_the_file_backend(tmp_path: Any, nothing_left: None) -> None:
    pool = MHATokenToKVPoolHost(DEVICE_POOL, 2.0, 0, 16, "page_first", False, "cpu", "shm")
    first = pool.alloc(32)
    assert first is not None
    pool.kv_buffer.normal_()
    store = HiCacheFile(HiCacheStorageConfig(model_name="mini"), file_path=str(tmp_path))
    index = int(first[16])
    assert store.set("page-hash", pool.get_data_page(index))
    written = pool.get_data_page(index).clone()
    pool.free(first)
    other = pool.alloc(pool.available_size())
    assert other is not None
    restored = store.get("page-hash", torch.empty_like(written))
    assert restored is not None
    pool.set_from_flat_data_page(0, restored)
    assert torch.equal(pool.get_data_page(0), written)
    del pool


def test_pinned_pool_is_unregistered_before_unmap(
    fake_cuda: helpers.FakeCuda, nothing_left: None
) -> None:
    pool = MHATokenToKVPoolHost(DEVICE_POOL, 2.0, 0, 16, "layer_first", True, "cpu", "shm")
    start, nbytes = pool.kv_buffer.data_ptr(), pool.kv_buffer.numel() * 2
    assert sum(fake_cuda.registered.values()) >= nbytes
    assert min(fake_cuda.registered) == start
    assert record_at(start).pinned_bytes >= nbytes  # hostpool's own pinning, counted
    assert pool.allocator.options.pin is False  # the swap was for that one call
    del pool
    gc.collect()
    assert fake_cuda.registered == {} and fake_cuda.problems == []


def test_foreign_allocators_are_registered_in_chunks(fake_cuda: helpers.FakeCuda) -> None:
    class TorchAllocator:
        def allocate(self, dims: Any, dtype: torch.dtype, device: str) -> torch.Tensor:
            return torch.empty(dims, dtype=dtype, device=device)

    buffer = alloc_with_host_register((3, 4096), torch.uint8, "cpu", True, TorchAllocator())
    ranges = buffer._sglang_cuda_host_registered_ranges  # type: ignore[attr-defined]
    assert sum(n for _, n in ranges) == 3 * 4096
    assert dict(ranges) == fake_cuda.registered
    cuda.unpin(fake_cuda, ranges)
    assert fake_cuda.registered == {}
