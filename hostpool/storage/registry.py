"""Storage backend registry: name -> (module, class, allocator), imported on first use.

Registering records strings only, so a backend whose dependencies are missing costs
nothing until someone asks for it. Each backend declares the host allocator its pages
must live in (`default` unless said otherwise): this is where a server's
`hicache_storage_backend` becomes an allocator type.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hostpool import events
from hostpool.config import load_mapping
from hostpool.errors import ConfigError
from hostpool.storage.base import HiCacheStorage, HiCacheStorageConfig

DYNAMIC = "dynamic"  # module and class come from the extra config
_DYNAMIC_FIELDS = ("backend_name", "module_path", "class_name")


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module_path: str
    class_name: str
    allocator: str = "default"


_lock = threading.Lock()
_specs: dict[str, BackendSpec] = {}
_classes: dict[str, type[HiCacheStorage]] = {}


def register_backend(
    name: str, module_path: str, class_name: str, allocator: str = "default"
) -> None:
    """Register a backend lazily: nothing is imported until it is first used.

    The class must subclass HiCacheStorage and take `(storage_config, mem_pool_host)`;
    `allocator` names the host allocator its pages must live in."""
    for what, value in (
        ("name", name),
        ("module_path", module_path),
        ("class_name", class_name),
        ("allocator", allocator),
    ):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"register_backend: {what} must be a non-empty string, got {value!r}")
    if name == DYNAMIC:
        raise ConfigError("'dynamic' is reserved: its module and class come from the extra config")
    spec = BackendSpec(name, module_path, class_name, allocator)
    with _lock:
        previous = _specs.get(name)
        _specs[name] = spec
        _classes.pop(name, None)
    if previous is not None and previous != spec:
        events.warning("hostpool.storage.backend_replaced", name=name, module=module_path)


def unregister_backend(name: str) -> None:
    """Forget a registered backend (a plugin unloading, or a test cleaning up)."""
    with _lock:
        if _specs.pop(name, None) is None:
            raise ConfigError(f"unknown storage backend {name!r}; registered: {sorted(_specs)}")
        _classes.pop(name, None)


def backend_names() -> list[str]:
    with _lock:
        return sorted([*_specs, DYNAMIC])


def backend_spec(name: str) -> BackendSpec:
    with _lock:
        spec = _specs.get(name)
    if spec is None:
        raise ConfigError(f"unknown storage backend {name!r}; registered: {backend_names()}")
    return spec


def load_backend_class(module_path: str, class_name: str, backend: str) -> type[HiCacheStorage]:
    """Import `module_path.class_name` and check that it is a HiCacheStorage."""
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ConfigError(
            f"storage backend {backend!r}: cannot import {module_path!r}: {exc}"
        ) from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"storage backend {backend!r}: {module_path} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, HiCacheStorage)):
        raise ConfigError(
            f"storage backend {backend!r}: {module_path}.{class_name} must inherit from "
            "HiCacheStorage"
        )
    return cls


def backend_class(name: str) -> type[HiCacheStorage]:
    """The backend's class, imported on first use and cached."""
    with _lock:
        cached = _classes.get(name)
    if cached is not None:
        return cached
    spec = backend_spec(name)
    cls = load_backend_class(spec.module_path, spec.class_name, name)
    with _lock:
        if _specs.get(name) == spec:  # not re-registered while we imported
            _classes[name] = cls
    return cls


def dynamic_spec(extra_config: object) -> BackendSpec:
    """The backend an extra config names: `backend_name`, `module_path`, `class_name`
    (required) and `allocator` (default `default`)."""
    extra = load_mapping(extra_config, what="hicache_storage_backend_extra_config")
    missing = [f for f in _DYNAMIC_FIELDS if not isinstance(extra.get(f), str) or not extra[f]]
    if missing:
        raise ConfigError(
            f"'dynamic' storage backend: extra config lacks {missing} (needs "
            f"{list(_DYNAMIC_FIELDS)}, optional 'allocator')"
        )
    return BackendSpec(
        extra["backend_name"],
        extra["module_path"],
        extra["class_name"],
        _allocator_field(extra),
    )


def _allocator_field(extra: Mapping[str, Any]) -> str:
    allocator = extra.get("allocator", "default")
    if not isinstance(allocator, str) or not allocator:
        raise ConfigError(f"extra config 'allocator' must be a non-empty string: {allocator!r}")
    return allocator


def create_backend(
    name: str,
    storage_config: HiCacheStorageConfig | None = None,
    mem_pool_host: Any | None = None,
    **kwargs: Any,
) -> HiCacheStorage:
    """An instance of backend `name`. `dynamic` builds the class its extra config names,
    with sglang's call for dynamic backends: `cls(storage_config, kwargs)`."""
    config = storage_config or HiCacheStorageConfig()
    if name == DYNAMIC:
        spec = dynamic_spec(config.extra_config)
        cls = load_backend_class(spec.module_path, spec.class_name, spec.name)
        return cls(config, kwargs)  # type: ignore[call-arg]
    backend = backend_class(name)(config, mem_pool_host)  # type: ignore[call-arg]
    return backend


def resolve_allocator(type_name: str, *, extra_config: object = None) -> str:
    """A registered allocator name for `type_name` (what `get_allocator_type` returns).

    An allocator name stands for itself; a storage backend stands for the allocator it
    declares (`dynamic`: the extra config's `allocator`). Anything else is a ConfigError
    listing what is known, never a silent default.
    """
    from hostpool.allocators import allocator_names  # torch: only when resolving

    known = allocator_names()
    if type_name in known:
        return type_name
    if type_name == DYNAMIC:
        allocator = _allocator_field(
            load_mapping(extra_config, what="hicache_storage_backend_extra_config")
        )
    else:
        with _lock:
            spec = _specs.get(type_name)
        if spec is None:
            raise ConfigError(
                f"unknown allocator type {type_name!r}: not a registered allocator {known} "
                f"nor a storage backend {backend_names()}"
            )
        allocator = spec.allocator
    if allocator not in known:
        raise ConfigError(
            f"storage backend {type_name!r} needs allocator {allocator!r}, which is not "
            f"registered; registered allocators: {known}"
        )
    return allocator


register_backend("file", "hostpool.storage.file", "HiCacheFile")
register_backend("shm", "hostpool.storage.shm", "HiCacheShm", allocator="shm")
