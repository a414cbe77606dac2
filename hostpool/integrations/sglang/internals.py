"""Every internal of sglang that hostpool relies on, read from sglang 0.5.23, here once;
`tests/sglang/test_internals.py` pins each against the installed sglang.

sglang has no public allocator API: the integration stands in for its implementation.
- where its host-memory entry points live (`COMMON`, `MMAP`, `BASE`) and their names:
  `HostTensorAllocator` (`__init__()` with no argument; `allocate(dims, dtype, device)`
  sets `dtype` and `dims`), `ShmHostTensorAllocator` (`fd`/`mm`), the dispatch
  `get_allocator_from_storage(allocator_type)`, the rule `get_allocator_type()` over
  `get_memory()`'s `hicache_storage_backend` and `..._extra_config` (inline JSON only),
  the private ROCm check `_uses_hip_owned_host_memory(pin_memory=, allocator=)` (an
  exact-type test), `alloc_shm(dims, dtype)` / `alloc_mmap(dims, dtype)`, and the host
  pool base class `HostKVCache` with its `destroy()`;
- what a host pool holds (`POOL_ATTRIBUTES`): its allocator as `allocator`, its label as
  `pool_label` (or `pool_name`), set in `__init__` before it allocates;
- where its own allocator subclasses import the base class from (the defining module,
  or a package's `__all__`), which must stay sglang's.

`GATE` is the range these were read from. Outside it `install()` leaves sglang alone
after one `hostpool.untested_version` warning: sglang runs unchanged, and hostpool
records none of its memory. Importing this module imports nothing of sglang.
"""

from __future__ import annotations

from hostpool.base.versiongate import VersionGate, distribution_version

RELIES_ON = "sglang's host allocator module layout and host pool attributes"
FALLBACK = "sglang is left unpatched: its host memory is not in hostpool's ledger"
GATE = VersionGate("sglang", (0, 5, 23), (0, 5, 24), relies_on=RELIES_ON, fallback=FALLBACK)

COMMON = "sglang.srt.mem_cache.pool_host.common"
MMAP = "sglang.srt.mem_cache.storage.mmap.mmap_allocator"
BASE = "sglang.srt.mem_cache.pool_host.base"

# In COMMON.
BASE_ALLOCATOR = "HostTensorAllocator"
SHM_ALLOCATOR = "ShmHostTensorAllocator"
DISPATCH = "get_allocator_from_storage"
TYPE_RULE = "get_allocator_type"
PUBLISHED_CONFIG = "get_memory"
HIP_CHECK = "_uses_hip_owned_host_memory"
# In MMAP.
ALLOC_SHM = "alloc_shm"
ALLOC_MMAP = "alloc_mmap"
# In BASE: the host pool class, and its teardown (each subclass may override it).
HOST_POOL = "HostKVCache"
DESTROY = "destroy"
# A host pool's own attributes (its __dict__): its allocator, and its free-text label.
POOL_ALLOCATOR = "allocator"
POOL_LABELS = ("pool_label", "pool_name")


def installed_version() -> str | None:
    """The installed sglang's version (sglang's `__version__` is set only after its
    package has imported most of its modules)."""
    return distribution_version("sglang")


def supported() -> bool:
    """Whether the installed sglang is one these internals were read from."""
    return GATE.check(installed_version())
