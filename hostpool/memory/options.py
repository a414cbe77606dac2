"""Allocator options, validated once into a frozen value the memory layer can trust."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any

from hostpool.base.units import parse_size
from hostpool.errors import InvalidRequestError
from hostpool.memory import kernel
from hostpool.words import (
    HUGEPAGE_MODES,
    POPULATE_CHOICES,
    SHM_BACKENDS,
    HugepageMode,
    PopulateChoice,
    ShmBackend,
)

POOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_PIN_CHUNK = 1 << 30
_DEFAULT_THREADS = min(8, os.cpu_count() or 1)


def validate_pool_name(pool: object) -> str:
    if not isinstance(pool, str) or not POOL_NAME.fullmatch(pool):
        raise InvalidRequestError(
            f"pool name must match [A-Za-z0-9_-]{{1,64}} (it becomes part of memfd names "
            f"and metric labels); got {pool!r}"
        )
    return pool


@dataclass(frozen=True)
class RegionOptions:
    """How one allocator's regions are made. Build with `RegionOptions.parse(**options)`."""

    hugepages: HugepageMode = "off"
    hugepage_size: int = 2 << 20
    populate: PopulateChoice = "auto"
    populate_threads: int = 0  # 0: min(8, cpu count)
    pin: bool = False
    pin_chunk_bytes: int = DEFAULT_PIN_CHUNK
    numa_node: int | None = None
    shm_backend: ShmBackend = "auto"
    fallback_dir: str = "/dev/shm"
    name_prefix: str = "hostpool."
    seal: bool = True

    @classmethod
    def parse(cls, **options: Any) -> RegionOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown allocator option(s) {unknown}; known: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        mode = options.get("hugepages", "off")
        mode = "off" if mode is None or mode is False else mode
        values["hugepages"] = _one_of("hugepages", mode, HUGEPAGE_MODES)
        if "hugepage_size" in options:
            values["hugepage_size"] = _hugepage_size(options["hugepage_size"])
        values["populate"] = _one_of("populate", options.get("populate", "auto"), POPULATE_CHOICES)
        threads = options.get("populate_threads", 0)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 256:
            raise InvalidRequestError(f"populate_threads must be an int in 0..256, got {threads!r}")
        values["populate_threads"] = threads
        values["pin"] = _flag("pin", options.get("pin", False))
        if "pin_chunk_bytes" in options:
            chunk = parse_size(options["pin_chunk_bytes"], what="pin_chunk_bytes")
            if chunk <= 0:
                raise InvalidRequestError("pin_chunk_bytes must be positive")
            values["pin_chunk_bytes"] = chunk
        values["numa_node"] = _numa_node(options.get("numa_node"))
        backend = options.get("shm_backend", "auto")
        values["shm_backend"] = _one_of("shm_backend", backend, SHM_BACKENDS)
        fallback_dir = options.get("fallback_dir", "/dev/shm")
        if not isinstance(fallback_dir, str | os.PathLike) or not os.path.isdir(fallback_dir):
            raise InvalidRequestError(
                f"fallback_dir must be an existing directory: {fallback_dir!r}"
            )
        values["fallback_dir"] = os.fspath(fallback_dir)
        prefix = options.get("name_prefix", "hostpool.")
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", prefix):
            raise InvalidRequestError(f"name_prefix must be [A-Za-z0-9_.-]{{1,64}}: {prefix!r}")
        values["name_prefix"] = prefix
        values["seal"] = _flag("seal", options.get("seal", True))
        return cls(**values)

    def effective_populate_threads(self) -> int:
        return self.populate_threads or _DEFAULT_THREADS


def _one_of(name: str, value: object, choices: tuple[str, ...]) -> object:
    """`value` of option `name` if it is one of `choices`; InvalidRequestError otherwise."""
    if value not in choices:
        raise InvalidRequestError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _flag(name: str, value: object) -> bool:
    """`value` of option `name` if it is a bool; InvalidRequestError otherwise."""
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be True or False, got {value!r}")
    return value


def _hugepage_size(value: object) -> int:
    size = parse_size(value, what="hugepage_size")
    if size <= 0 or size & (size - 1):
        raise InvalidRequestError(
            f"hugepage_size must be a power of two such as 2MB or 1GB: {value!r}"
        )
    if size < 64 << 10:
        # A size the host lacks (1GB here) still falls back, counted, at allocation time;
        # one no hardware has is a bad request.
        sizes = sorted(kernel.hugepage_pools())
        raise InvalidRequestError(
            f"hugepage_size {value!r} is not a hugepage size; this host has "
            f"{[s // 1024 for s in sizes]} kB pages"
        )
    return size


def _numa_node(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"numa_node must be a non-negative int or None, got {value!r}")
    nodes = kernel.numa_nodes()
    if value not in nodes:
        raise InvalidRequestError(f"numa_node {value} is not online; online nodes: {nodes}")
    return value
