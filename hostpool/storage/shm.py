"""`shm`: the dummy backend. Shared memory is local, so there is nothing to transfer:
every get misses and every set succeeds. Its point is the allocator it declares (`shm`),
which puts the host pool in memfds another process can map."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hostpool.storage.base import HiCacheStorage, HiCacheStorageConfig

if TYPE_CHECKING:
    import torch


class HiCacheShm(HiCacheStorage):
    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        mem_pool_host: Any | None = None,
    ) -> None:
        self.storage_config = storage_config or HiCacheStorageConfig()
        self.mem_pool_host = mem_pool_host

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        return None

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return True

    def exists(self, key: str) -> bool:
        return False
