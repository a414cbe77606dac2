"""HiCache storage backends and the registry that maps a backend to its host allocator.

`file` and `shm` are built in; others register with `register_backend` and are imported
on first use. Importing this package does not import torch.
"""

from hostpool.storage.base import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from hostpool.storage.registry import (
    BackendSpec,
    backend_class,
    backend_names,
    create_backend,
    register_backend,
    resolve_allocator,
    unregister_backend,
)

__all__ = [
    "BackendSpec",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "backend_class",
    "backend_names",
    "create_backend",
    "register_backend",
    "resolve_allocator",
    "unregister_backend",
]
