"""The HiCache storage interface (sglang's `HiCacheStorage`): a key -> page store.

Keys are content hashes of token prefixes; values are pages of a host KV pool. The
signatures are sglang's, so a backend written for sglang fits here unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class HiCacheStorageConfig:
    """What a backend knows about the rank that uses it (sglang's fields)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    is_page_first_layout: bool = False
    model_name: str | None = None
    extra_config: dict[str, Any] | None = None


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: list[str] | None = None
    extra_info: dict[str, Any] | None = None


class HiCacheStorage(ABC):
    """A generic key-value store for KV cache pages."""

    mem_pool_host: Any = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    @abstractmethod
    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """The value of `key` (read into `target_location` when given), or None."""

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """One result per key, None for a miss. A backend with a real batch path overrides
        this; the default asks `get` key by key."""
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    @abstractmethod
    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store `value` under `key`; True on success."""

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store every pair; True only if all succeeded (default: `set` key by key)."""
        if values is None:
            values = [None] * len(keys)  # `set` decides what a missing value means
        if len(values) != len(keys):
            return False
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many keys, counted from the first, exist (a prefix hit length)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def clear(self) -> bool:
        """Drop every stored page; True on success."""
        return True
