"""hostpool: tracked, shared-memory host KV-cache pools for LLM servers.

Names are imported lazily (PEP 562): `import hostpool.testing` or `hostpool.proc.procfs`
must not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hostpool._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "HostPoolManager": "hostpool.manager",
    "LeakReport": "hostpool.manager",
    "HostTensorAllocator": "hostpool.allocators",
    "ShmHostTensorAllocator": "hostpool.allocators",
    "MmapHostTensorAllocator": "hostpool.allocators",
    "DefaultHostTensorAllocator": "hostpool.allocators",
    "create_allocator": "hostpool.allocators",
    "register_allocator": "hostpool.allocators",
    # sglang's shapes and rule live once, in its integration (importing no sglang).
    "alloc_shm": "hostpool.integrations.sglang.shapes",
    "alloc_mmap": "hostpool.integrations.sglang.shapes",
    "get_allocator_type": "hostpool.integrations.sglang.rules",
    "AllocationRecord": "hostpool.records",
    "get_ledger": "hostpool.lifecycle",
    "HostPoolError": "hostpool.errors",
    "InvalidRequestError": "hostpool.errors",
    "ConfigError": "hostpool.errors",
    "AllocationError": "hostpool.errors",
    "HugepageUnavailableError": "hostpool.errors",
}

__all__ = [
    "AllocationError",
    "AllocationRecord",
    "ConfigError",
    "DefaultHostTensorAllocator",
    "HostPoolError",
    "HostPoolManager",
    "HostTensorAllocator",
    "HugepageUnavailableError",
    "InvalidRequestError",
    "LeakReport",
    "MmapHostTensorAllocator",
    "ShmHostTensorAllocator",
    "__version__",
    "alloc_mmap",
    "alloc_shm",
    "create_allocator",
    "get_allocator_type",
    "get_ledger",
    "register_allocator",
]

if TYPE_CHECKING:
    from hostpool.allocators import (
        DefaultHostTensorAllocator,
        HostTensorAllocator,
        MmapHostTensorAllocator,
        ShmHostTensorAllocator,
        create_allocator,
        register_allocator,
    )
    from hostpool.errors import (
        AllocationError,
        ConfigError,
        HostPoolError,
        HugepageUnavailableError,
        InvalidRequestError,
    )
    from hostpool.integrations.sglang.rules import get_allocator_type
    from hostpool.integrations.sglang.shapes import alloc_mmap, alloc_shm
    from hostpool.lifecycle import get_ledger
    from hostpool.manager import HostPoolManager, LeakReport
    from hostpool.records import AllocationRecord

__getattr__, __dir__ = lazy_exports("hostpool", _EXPORTS, globals())
