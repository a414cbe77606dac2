"""hostpool: tracked, shared-memory host KV-cache pools for LLM servers.

Names are imported lazily (PEP 562): `import hostpool.testing` or `hostpool.proc.procfs`
must not pay for torch. hostpool never installs torch (the engine's environment brings
its build): the names that hand out tensors raise TorchUnavailableError without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hostpool._lazy import lazy_exports
from hostpool._version import __version__

_EXPORTS = {
    "HostPoolManager": "hostpool.manager",
    "LeakReport": "hostpool.core.manager",
    "HostTensorAllocator": "hostpool.core.allocators",
    "ShmHostTensorAllocator": "hostpool.core.allocators",
    "MmapHostTensorAllocator": "hostpool.core.allocators",
    "DefaultHostTensorAllocator": "hostpool.core.allocators",
    "create_allocator": "hostpool.core.allocators",
    "register_allocator": "hostpool.core.allocators",
    # sglang's shapes and rule live once, in its integration (importing no sglang).
    "alloc_shm": "hostpool.integrations.sglang.shapes",
    "alloc_mmap": "hostpool.integrations.sglang.shapes",
    "get_allocator_type": "hostpool.integrations.sglang.rules",
    "AllocationRecord": "hostpool.core.records",
    "get_ledger": "hostpool.core.ledger",
    "HostPoolError": "hostpool.errors",
    "InvalidRequestError": "hostpool.errors",
    "ConfigError": "hostpool.errors",
    "AllocationError": "hostpool.errors",
    "HugepageUnavailableError": "hostpool.errors",
    "TorchUnavailableError": "hostpool.errors",
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
    "TorchUnavailableError",
    "__version__",
    "alloc_mmap",
    "alloc_shm",
    "create_allocator",
    "get_allocator_type",
    "get_ledger",
    "register_allocator",
]

if TYPE_CHECKING:
    from hostpool.core.allocators import (
        DefaultHostTensorAllocator,
        HostTensorAllocator,
        MmapHostTensorAllocator,
        ShmHostTensorAllocator,
        create_allocator,
        register_allocator,
    )
    from hostpool.core.ledger import get_ledger
    from hostpool.core.manager import LeakReport
    from hostpool.core.records import AllocationRecord
    from hostpool.errors import (
        AllocationError,
        ConfigError,
        HostPoolError,
        HugepageUnavailableError,
        InvalidRequestError,
        TorchUnavailableError,
    )
    from hostpool.integrations.sglang.rules import get_allocator_type
    from hostpool.integrations.sglang.shapes import alloc_mmap, alloc_shm
    from hostpool.manager import HostPoolManager

__getattr__, __dir__ = lazy_exports("hostpool", _EXPORTS, globals())
