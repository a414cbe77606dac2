"""Host KV pools: layouts and sizing, slot free-lists, the hybrid assembler, and the
host-wide budget shared by the rank processes of one host.

Names are imported lazily (PEP 562): a launcher that only needs `HostBudget` does not
pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hostpool._lazy import lazy_exports

_EXPORTS = {
    "HostPool": "hostpool.pools.assembler",
    "HostPoolArgs": "hostpool.pools.assembler",
    "HostPoolPlan": "hostpool.pools.assembler",
    "HostPools": "hostpool.pools.assembler",
    "PoolPlan": "hostpool.pools.assembler",
    "assemble_host_pools": "hostpool.pools.assembler",
    "build_host_pools": "hostpool.pools.assembler",
    "plan_host_pools": "hostpool.pools.assembler",
    "SlotFreeList": "hostpool.pools.freelist",
    "HostBudget": "hostpool.pools.hostbudget",
    "Buffer": "hostpool.pools.layouts",
    "IndexerLayout": "hostpool.pools.layouts",
    "MHALayout": "hostpool.pools.layouts",
    "MLALayout": "hostpool.pools.layouts",
    "MambaLayout": "hostpool.pools.layouts",
    "Sizing": "hostpool.pools.layouts",
    "size_pool": "hostpool.pools.layouts",
}

__all__ = [
    "Buffer",
    "HostBudget",
    "HostPool",
    "HostPoolArgs",
    "HostPoolPlan",
    "HostPools",
    "IndexerLayout",
    "MHALayout",
    "MLALayout",
    "MambaLayout",
    "PoolPlan",
    "Sizing",
    "SlotFreeList",
    "assemble_host_pools",
    "build_host_pools",
    "plan_host_pools",
    "size_pool",
]

if TYPE_CHECKING:
    from hostpool.pools.assembler import (
        HostPool,
        HostPoolArgs,
        HostPoolPlan,
        HostPools,
        PoolPlan,
        assemble_host_pools,
        build_host_pools,
        plan_host_pools,
    )
    from hostpool.pools.freelist import SlotFreeList
    from hostpool.pools.hostbudget import HostBudget
    from hostpool.pools.layouts import (
        Buffer,
        IndexerLayout,
        MambaLayout,
        MHALayout,
        MLALayout,
        Sizing,
        size_pool,
    )

__getattr__, __dir__ = lazy_exports("hostpool.pools", _EXPORTS, globals())
