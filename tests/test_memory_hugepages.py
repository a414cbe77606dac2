"""Hugepages against the real hugetlb pool (root: the test reserves and restores pages)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from hostpool import (
    HugepageUnavailableError,
    MmapHostTensorAllocator,
    ShmHostTensorAllocator,
)
from hostpool.memory import kernel
from tests import helpers

MiB = 1 << 20


def _free_2m() -> int:
    with open("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages") as f:
        return int(f.read())


@pytest.fixture
def no_hugepages(root: None) -> object:
    with helpers.reserved_hugepages(0):
        yield


def test_prefer_without_pages_falls_back_with_reasons(
    no_hugepages: None, no_leaked_fds: None
) -> None:
    shm_alloc = ShmHostTensorAllocator("hp", hugepages="prefer", hugepage_size="2MB")
    t = shm_alloc.allocate((3 * MiB,), torch.uint8)
    region = shm_alloc.regions[0]
    assert region.facts.page_size == 4096
    assert region.facts.hugepage_fallbacks[0] == "hugetlb_pool_short"
    expected_thp = kernel.shmem_thp_allowed()
    assert region.facts.thp_advised == expected_thp
    assert ("thp_disabled" in region.facts.hugepage_fallbacks) == (not expected_thp)
    shm_alloc.close()
    del t


def test_required_without_pages_names_the_sysctl(no_hugepages: None, no_leaked_fds: None) -> None:
    alloc = ShmHostTensorAllocator("hp", hugepages="required", hugepage_size="2MB")
    with pytest.raises(HugepageUnavailableError) as exc:
        alloc.allocate((3 * MiB,), torch.uint8)
    message = str(exc.value)
    assert "nr_hugepages" in message and "need 2 pages of 2MiB" in message
    assert exc.value.reason == "hugepages"


@pytest.mark.hugepages
def test_hugetlb_memfd_whole_pages_unmapped_on_release(
    hugepages_2m: int, no_leaked_fds: None
) -> None:
    free_before = _free_2m()
    alloc = ShmHostTensorAllocator("huge", hugepages="required", hugepage_size="2MB")
    t = alloc.allocate((5 * MiB,), torch.uint8)  # 3 hugepages, not 5 MiB
    region = alloc.regions[0]
    assert region.facts.page_size == 2 * MiB and region.facts.mapped_bytes == 6 * MiB
    link = os.readlink(f"/proc/self/fd/{alloc.fd}")
    assert link.startswith("/memfd:hostpool.huge.")
    assert os.fstat(alloc.fd).st_size == 6 * MiB
    assert _free_2m() == free_before - 3  # populated: taken from the pool now
    assert region.resident_bytes() == 6 * MiB  # st_blocks counts hugetlb pages too
    assert helpers.range_mapped(region.facts.address, region.facts.mapped_bytes)
    t[-1] = 3
    address, length = region.facts.address, region.facts.mapped_bytes
    alloc.close()
    del t
    gc.collect()
    assert not helpers.range_mapped(address, length)
    assert _free_2m() == free_before


@pytest.mark.hugepages
def test_short_pool_fails_before_touching_anything(hugepages_2m: int, no_leaked_fds: None) -> None:
    free_before = _free_2m()
    maps_before = helpers.mapped_ranges()
    alloc = ShmHostTensorAllocator("short", hugepages="required", hugepage_size="2MB")
    with pytest.raises(HugepageUnavailableError):
        alloc.allocate(((free_before + 1) * 2 * MiB,), torch.uint8)
    assert _free_2m() == free_before
    assert helpers.fd_links() == {} or all("short" not in v for v in helpers.fd_links().values())
    assert len(helpers.mapped_ranges()) <= len(maps_before) + 1  # no new hostpool mapping


@pytest.mark.hugepages
def test_mmap_enomem_race_is_caught_at_mmap(
    hugepages_2m: int, monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    """The pool looked big enough, but the kernel refuses at mmap: clean error or fallback."""
    free = _free_2m()
    fake = kernel.HugepagePool(2 * MiB, total=10**6, free=10**6, reserved=0, surplus=0)
    monkeypatch.setattr(kernel, "hugepage_pool", lambda size: fake)
    too_big = (free + 4) * 2 * MiB
    for cls in (ShmHostTensorAllocator, MmapHostTensorAllocator):
        with pytest.raises(HugepageUnavailableError):
            cls("race", hugepages="required", hugepage_size="2MB", populate="none").allocate(
                (too_big,), torch.uint8
            )
        alloc = cls("race", hugepages="prefer", hugepage_size="2MB", populate="none")
        t = alloc.allocate((too_big,), torch.uint8)
        assert alloc.regions[0].facts.hugepage_fallbacks[0] == "hugetlb_pool_short"
        assert alloc.regions[0].facts.page_size == 4096
        alloc.close()
        del t
    assert _free_2m() == free


@pytest.mark.hugepages
def test_anonymous_hugetlb(hugepages_2m: int) -> None:
    free_before = _free_2m()
    alloc = MmapHostTensorAllocator("anonhuge", hugepages="required", hugepage_size="2MB")
    t = alloc.allocate((1, 2 * MiB + 1), torch.uint8)
    assert alloc.regions[0].facts.mapped_bytes == 4 * MiB
    assert _free_2m() == free_before - 2
    alloc.close()
    del t
    gc.collect()
    assert _free_2m() == free_before
