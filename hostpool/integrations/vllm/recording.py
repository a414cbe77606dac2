"""What the vLLM instrument records: vLLM's `SharedOffloadRegion` as a `VllmRegion` (vLLM
owns its fd and mapping), and the CPU tensors of `CPUOffloadingWorker`'s `torch.zeros`
fallback as foreign regions, each in the ledger under pool `vllm_offload`."""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hostpool.base import events
from hostpool.integrations.vllm import internals as vllm_internals
from hostpool.memory.interface import RegionFacts, RegionLike
from hostpool.memory.region import dup_if_same

POOL = "vllm_offload"
REGION_ALLOCATOR = "vllm_shared_region"
TENSOR_ALLOCATOR = "vllm_torch"

# Region and owner ids of this module's records: a range of their own, below the ids
# hostpool's allocators (counting up from 1) and sglang's foreign owners (-1, -2, ...) use.
_ID_BASE = 1 << 48
_ids = itertools.count(1)


def next_owner_id() -> int:
    """A region or owner id of this integration's records (negative, in its own range)."""
    return -(_ID_BASE + next(_ids))


@dataclass(frozen=True, eq=False)
class VllmRegion:
    """A `SharedOffloadRegion` as the ledger sees it (a `RegionLike`): vLLM owns the fd and
    the mapping, hostpool holds weak references and the inode (nothing here opens, maps or
    closes). How it was made is its `RegionFacts`, as every maker records them (vLLM maps
    exactly what it sized; no seals, NUMA binding or THP advice of hostpool's).

    `fd` is vLLM's fd while it still names the region's inode; `open_fd_count()` is that
    fd plus mmap's internal dup while vLLM's mapping is open: what /proc/PID/fd shows.
    """

    facts: RegionFacts
    source: weakref.ReferenceType[Any] = field(repr=False)  # vLLM's SharedOffloadRegion
    mapping: weakref.ReferenceType[mmap.mmap] = field(repr=False)  # its mmap_obj
    # What vLLM's region never has: CUDA pins of hostpool's, an fd of hostpool's to leave
    # open.
    pinned_bytes: int = field(default=0, init=False, repr=False)
    fd_reused: int | None = field(default=None, init=False, repr=False)

    @property
    def fd(self) -> int | None:
        fd, _ = self._stat()
        return fd

    def _stat(self) -> tuple[int | None, int]:
        """(vLLM's fd, bytes the file holds) when the fd still names our inode."""
        fd = vllm_internals.region_fd(self.source())
        if fd is None:
            return None, 0
        try:
            st = os.fstat(fd)
        except OSError:
            return None, 0
        if (st.st_dev, st.st_ino) != self.facts.dev_ino:
            return None, 0  # closed by vLLM and the number reused: not ours to count
        return fd, min(st.st_blocks * 512, self.facts.mapped_bytes)

    @property
    def mapped(self) -> bool:
        mm = self.mapping()
        return mm is not None and not mm.closed

    def mmap(self) -> None:
        """None: the mapping is vLLM's, never handed out by hostpool."""
        return None

    def open_fd_count(self) -> int:
        return self.scrape()[0]

    def borrow_fd(self) -> int | None:
        fd, dev_ino = self.fd, self.facts.dev_ino
        return None if fd is None or dev_ino is None else dup_if_same(fd, dev_ino)

    def scrape(self) -> tuple[int, int]:
        fd, resident = self._stat()
        return (fd is not None) + self.mapped, resident

    def close(self) -> bool:
        """Closes nothing (vLLM's `cleanup()` does); True once vLLM's mapping is closed."""
        return not self.mapped


if TYPE_CHECKING:

    def _conforms(region: VllmRegion) -> RegionLike:
        return region  # mypy: VllmRegion implements RegionLike


@dataclass
class Populate:
    """What vLLM's populate did inside one region constructor on this thread."""

    mode: str = "none"  # a creator-only joiner populates nothing
    seconds: float = 0.0
    waited: float = 0.0  # in vLLM's barrier: other ranks' time, not this allocation's


def record_region(source: Any, seconds: float, populate: Populate) -> VllmRegion:
    """Record vLLM's SharedOffloadRegion `source`, just constructed (`seconds` of it
    this rank's own, `populate` what its populate did), as a VllmRegion in the ledger;
    returns the record. Raises what fstat or a malformed `source` raises."""
    from hostpool.core.ledger import get_ledger

    state = vllm_internals.read_region(source)
    st = os.fstat(state.fd)
    nbytes = state.total_size_bytes
    ledger = get_ledger()
    rid = next_owner_id()
    facts = RegionFacts(
        id=rid,
        pool=POOL,
        address=state.address,
        mapped_bytes=nbytes,  # vLLM maps exactly what it sized
        kind="shm",
        backend="devshm",
        requested_bytes=nbytes,
        page_size=mmap.PAGESIZE,
        name=os.path.basename(state.path),
        populate_mode=populate.mode,
        populate_seconds=populate.seconds,
        dev_ino=(st.st_dev, st.st_ino),
    )
    region = VllmRegion(facts, source=weakref.ref(source), mapping=weakref.ref(state.mapping))
    # The mapping goes with vLLM's mmap object. Its end is explicit when vLLM's cleanup()
    # ran (the region object lives on with `mmap_obj = None`), else a leak: the object was
    # collected (its fd stays open: vLLM closes it only in cleanup()).
    gone = functools.partial(mapping_gone, ledger.unmapped_callback(), weakref.ref(source), rid)
    weakref.finalize(state.mapping, gone).atexit = False
    _into_ledger(ledger, region, REGION_ALLOCATOR, rid, seconds, (nbytes,), "torch.int8")
    events.info(
        "hostpool.vllm.recorded",
        pool=POOL,
        allocator=REGION_ALLOCATOR,
        bytes=nbytes,
        name=facts.name,
        fd=state.fd,
        rank=state.rank,
        seconds=round(seconds, 6),
    )
    return region


def mapping_gone(
    notify: Callable[..., None], source_ref: weakref.ReferenceType[Any], region_id: int
) -> None:
    """Finalizer of vLLM's mmap: the region ended, `explicit` if vLLM's cleanup() ran."""
    # Finalizer (any thread, inside GC): no lock, no reference to the record.
    notify(region_id, "explicit" if vllm_internals.cleaned_up(source_ref()) else "collected")


def untracked(exc: BaseException) -> None:
    """`hostpool.vllm.untracked`: recording failed; vLLM runs on unchanged."""
    events.warning(
        "hostpool.vllm.untracked",
        pool=POOL,
        error=f"{type(exc).__name__}: {exc}",
        effect="vLLM runs unchanged; this region is not in hostpool's ledger",
    )


def release_owner(owner: int) -> None:
    """Release every region recorded for `owner` explicitly."""
    from hostpool.core.ledger import get_ledger

    ledger = get_ledger()
    for region in ledger.regions(owner=owner):
        ledger.release(region.facts.id)


@functools.cache
def zeros_mode_type() -> type:
    """The torch function mode that records the CPU tensors `torch.zeros` makes."""
    import torch
    from torch.overrides import TorchFunctionMode

    class ZerosMode(TorchFunctionMode):
        """While vLLM's worker constructor runs on this thread, each CPU tensor
        `torch.zeros` makes is recorded. A torch function mode is thread-local and
        scoped to the `with`: torch stays unchanged for everyone else."""

        def __init__(self, owner: int) -> None:
            super().__init__()
            self.owner = owner

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            result = func(*args, **(kwargs or {}))
            if (
                func is torch.zeros
                and isinstance(result, torch.Tensor)
                and result.device.type == "cpu"
                and result.numel()
            ):
                try:
                    return record_tensor(result, self.owner)
                except Exception as exc:  # a record must never stop vLLM
                    untracked(exc)
            return result

    return ZerosMode


def record_tensor(tensor: Any, owner: int) -> Any:
    """Record a CPU tensor vLLM made as a foreign region of `owner`; returns the view
    over it that vLLM keeps instead."""
    from hostpool.core.ledger import get_ledger
    from hostpool.memory.holders import adopt

    ledger = get_ledger()
    region, view = adopt(tensor, POOL, ledger.unmapped_callback())
    _into_ledger(ledger, region, TENSOR_ALLOCATOR, owner, 0.0, tuple(view.shape), str(view.dtype))
    events.info(
        "hostpool.vllm.recorded",
        pool=POOL,
        allocator=TENSOR_ALLOCATOR,
        bytes=region.facts.mapped_bytes,
    )
    return view


def _into_ledger(
    ledger: Any,
    region: RegionLike,
    allocator: str,
    owner: int,
    seconds: float,
    dims: tuple[int, ...],
    dtype: str,
) -> None:
    from hostpool.core.records import capture_stack

    ledger.add_pool(POOL)
    ledger.record(
        region,
        allocator=allocator,
        owner=owner,
        stack=capture_stack() if ledger.track_stacks else None,
        seconds=seconds,
        dims=dims,
        dtype=dtype,
    )
