"""Allocator options, validated once into a frozen value the memory layer can trust."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
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
        """The options' value, checked; an InvalidRequestError names the wrong `option`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown allocator option(s) {unknown}; known: {sorted(known)}",
                option=unknown[0],
            )
        values: dict[str, Any] = {}
        for name, read in _PARSERS.items():
            try:
                parsed = read(options)
            except InvalidRequestError as exc:
                exc.option = exc.option or name
                raise
            if parsed is not _DEFAULT:
                values[name] = parsed
        return cls(**values)

    def effective_populate_threads(self) -> int:
        return self.populate_threads or _DEFAULT_THREADS


_DEFAULT: Any = object()  # a parser's "not given: the field's default"


def _hugepages(options: dict[str, Any]) -> object:
    mode = options.get("hugepages", "off")
    return _one_of("hugepages", "off" if mode is None or mode is False else mode, HUGEPAGE_MODES)


def _populate_threads(options: dict[str, Any]) -> int:
    threads = options.get("populate_threads", 0)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 256:
        raise InvalidRequestError(f"populate_threads must be an int in 0..256, got {threads!r}")
    return threads


def _pin_chunk_bytes(options: dict[str, Any]) -> object:
    if "pin_chunk_bytes" not in options:
        return _DEFAULT
    chunk = parse_size(options["pin_chunk_bytes"], what="pin_chunk_bytes")
    if chunk <= 0:
        raise InvalidRequestError("pin_chunk_bytes must be positive")
    return chunk


def _fallback_dir(options: dict[str, Any]) -> str:
    fallback_dir = options.get("fallback_dir", "/dev/shm")
    if not isinstance(fallback_dir, str | os.PathLike) or not os.path.isdir(fallback_dir):
        raise InvalidRequestError(f"fallback_dir must be an existing directory: {fallback_dir!r}")
    return os.fspath(fallback_dir)


def _name_prefix(options: dict[str, Any]) -> str:
    prefix = options.get("name_prefix", "hostpool.")
    if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", prefix):
        raise InvalidRequestError(f"name_prefix must be [A-Za-z0-9_.-]{{1,64}}: {prefix!r}")
    return prefix


# One reader per option: what `options` says of it, checked (or _DEFAULT).
_PARSERS: dict[str, Callable[[dict[str, Any]], object]] = {
    "hugepages": _hugepages,
    "hugepage_size": lambda o: (
        _hugepage_size(o["hugepage_size"]) if "hugepage_size" in o else _DEFAULT
    ),
    "populate": lambda o: _one_of("populate", o.get("populate", "auto"), POPULATE_CHOICES),
    "populate_threads": _populate_threads,
    "pin": lambda o: _flag("pin", o.get("pin", False)),
    "pin_chunk_bytes": _pin_chunk_bytes,
    "numa_node": lambda o: _numa_node(o.get("numa_node")),
    "shm_backend": lambda o: _one_of("shm_backend", o.get("shm_backend", "auto"), SHM_BACKENDS),
    "fallback_dir": _fallback_dir,
    "name_prefix": _name_prefix,
    "seal": lambda o: _flag("seal", o.get("seal", True)),
}


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


def _hugepage_size(value: object) -> object:
    if value is _DEFAULT:
        return _DEFAULT
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
