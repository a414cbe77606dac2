"""Backends for the registry's `dynamic` and lazy-loading tests: the registry imports
this module by name; tests never import it themselves."""

from __future__ import annotations

from typing import Any

import torch

from hostpool.storage.base import HiCacheStorage, HiCacheStorageConfig


class DictStorage(HiCacheStorage):
    """In-memory pages; built the way sglang builds dynamic backends: (config, kwargs)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.kwargs = kwargs
        self.pages: dict[str, torch.Tensor] = {}

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        page = self.pages.get(key)
        if page is not None and target_location is not None:
            target_location.copy_(page)
            return target_location  # type: ignore[no-any-return]
        return page

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        self.pages[key] = value.clone()  # type: ignore[union-attr]
        return True

    def exists(self, key: str) -> bool:
        return key in self.pages


class NotAStorage:
    """Has the methods, lacks the base class: the registry must refuse it."""

    def __init__(self, *args: Any) -> None:
        pass

    def get(self, key: str) -> None:
        return None
