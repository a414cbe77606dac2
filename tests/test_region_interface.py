"""`RegionLike`: the ledger, the collector, snapshots and the share server see hostpool's
regions and vLLM's the same way, through one named interface that each implements on its
own (mypy checks conformance where each is defined; this checks it at run time and drives
a `VllmRegion` over real memory, with a stand-in for vLLM's region object)."""

from __future__ import annotations

import dataclasses
import gc
import mmap
import os

import torch

from hostpool.core.allocators import ShmHostTensorAllocator
from hostpool.core.ledger import get_ledger
from hostpool.integrations.vllm.recording import Populate, VllmRegion, record_region
from hostpool.memory.interface import RegionFacts, RegionLike
from hostpool.memory.region import Region
from hostpool.metrics import measure

MEMBERS = {name for name in vars(RegionLike) if not name.startswith("_")}


def test_both_kinds_have_every_member_and_neither_inherits_the_other() -> None:
    assert {"facts", "fd", "mapped", "scrape", "close", "borrow_fd", "mmap"} <= MEMBERS
    for cls in (Region, VllmRegion):
        assert all(hasattr(cls, m) or m in cls.__dataclass_fields__ for m in MEMBERS), cls
        # The facts are one record, not members of each kind (nothing to drift apart).
        assert cls.__dataclass_fields__["facts"].type in (RegionFacts, "RegionFacts")
        assert not set(cls.__dataclass_fields__) & {f.name for f in dataclasses.fields(RegionFacts)}
    # Neither inherits the other, nor a base class of facts.
    assert VllmRegion.__mro__[1:] == (object,) and Region.__mro__[1:] == (object,)
    allocator = ShmHostTensorAllocator("iface")
    tensor = allocator.allocate((4096,), torch.uint8)
    region: RegionLike = allocator.regions[0]
    assert isinstance(region, Region) and region.mapped and region.scrape()[0] == 2
    del tensor
    allocator.close()


class VllmLike:
    """What vLLM's SharedOffloadRegion holds once constructed, over a real memfd."""

    def __init__(self, nbytes: int) -> None:
        self.fd: int | None = os.memfd_create("vllm_offload_iface_test")
        os.ftruncate(self.fd, nbytes)
        self.mmap_obj: mmap.mmap | None = mmap.mmap(self.fd, nbytes)
        self.mmap_obj[:nbytes] = b"\1" * nbytes  # resident
        self.base_tensor: torch.Tensor | None = torch.frombuffer(
            memoryview(self.mmap_obj), dtype=torch.int8
        )
        self.total_size_bytes = nbytes
        self.mmap_path = "/dev/shm/vllm_offload_x.mmap"
        self.rank = 0

    def cleanup(self) -> None:
        """vLLM's order: the views, then the mapping (mmap_obj = None), then the fd."""
        self.base_tensor = None
        assert self.mmap_obj is not None
        self.mmap_obj.close()
        self.mmap_obj = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def test_a_vllm_region_is_measured_snapshotted_and_released_like_any_other() -> None:
    nbytes = 4 * mmap.PAGESIZE
    source = VllmLike(nbytes)
    ledger = get_ledger()
    region = record_region(source, 0.01, Populate(mode="madvise", seconds=0.005))
    as_seen: RegionLike = region
    st = os.fstat(source.fd)
    assert as_seen.facts.dev_ino == (st.st_dev, st.st_ino) and as_seen.mmap() is None
    assert (as_seen.facts.pool, as_seen.facts.kind, as_seen.facts.backend) == (
        "vllm_offload",
        "shm",
        "devshm",
    )
    assert as_seen.facts.name == "vllm_offload_x.mmap" and as_seen.facts.mapped_bytes == nbytes
    assert source.base_tensor is not None and source.fd is not None
    assert as_seen.facts.address == source.base_tensor.data_ptr()
    assert as_seen.scrape() == (2, nbytes)  # vLLM's fd and mmap's dup; every page resident
    dup = as_seen.borrow_fd()
    assert dup is not None and os.fstat(dup).st_ino == st.st_ino
    os.close(dup)
    [record] = [r for r in ledger.snapshot(["vllm_offload"]) if r.id == region.facts.id]
    assert (record.allocator, record.state, record.open_fds) == ("vllm_shared_region", "live", 2)
    assert (record.populate_mode, record.seals, record.pinned_bytes) == ("madvise", 0, 0)
    assert (record.device, record.inode) == (st.st_dev, st.st_ino)
    fds = measure(ledger)["hostpool_open_fds"]
    assert fds[("vllm_offload",)] >= 2
    explicit_before = ledger.counters().releases_total.get(("vllm_offload", "explicit"), 0)
    # vLLM's fd number reused by another file: no longer counted as the region's.
    os.close(source.fd)
    other = os.open("/dev/null", os.O_RDONLY)
    try:
        assert other == source.fd and as_seen.fd is None and as_seen.scrape() == (1, 0)
    finally:
        os.close(other)
    source.fd = None
    source.cleanup()
    gc.collect()
    ledger.drain()
    assert not as_seen.mapped and as_seen.close() is True and as_seen.scrape() == (0, 0)
    assert all(r.id != region.facts.id for r in ledger.snapshot(["vllm_offload"]))
    explicit = ledger.counters().releases_total.get(("vllm_offload", "explicit"), 0)
    assert explicit == explicit_before + 1  # cleanup() ran: mmap_obj is None
