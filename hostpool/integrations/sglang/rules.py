"""sglang's rules that hostpool answers with, here once: `get_allocator_type` (also
`hostpool.get_allocator_type`, and the stand-in that answers where sglang asks) and
`SGLANG_HUGEPAGE_SIZE` as hostpool options. Pure: no sglang import, no torch."""

from __future__ import annotations

import json
import os
from typing import Any

from hostpool.base import events
from hostpool.errors import ConfigError

BAD_EXTRA_CONFIG = "hostpool.sglang.bad_extra_config"


def allocator_type_rule(
    backend: Any, extra_config: Any, *, hostpool_forms: bool = False
) -> tuple[str, str | None]:
    """sglang 0.5.23's `get_allocator_type` rule over explicit values: (answer, problem).

    "shm" for the shm backend, or for "dynamic" whose extra config has `"allocator":
    "shm"`; else the backend name; else "default". sglang reads the extra config as inline
    JSON and ignores one it cannot read (the answer is then "dynamic"); `problem` says
    what was wrong with it (None when nothing was). `hostpool_forms` also takes the extra
    config as a dict or `@path` to a .json/.toml/.yaml/.yml file (hostpool's own API).
    Pure: no sglang import, no event. A backend that is neither a string nor None (never
    sglang's, whose argument parser gives one of its names) is a ConfigError.
    """
    if backend is not None and not isinstance(backend, str):
        raise ConfigError(f"hicache_storage_backend must be a string, got {backend!r}")
    if backend == "shm":
        return "shm", None
    problem = None
    if backend == "dynamic" and extra_config:
        config, problem = _extra_config(extra_config, hostpool_forms)
        if config is not None and config.get("allocator") == "shm":
            return "shm", None
    return backend or "default", problem


def _extra_config(extra: Any, hostpool_forms: bool) -> tuple[dict[str, Any] | None, str | None]:
    """The extra config as a mapping, else (None, what is wrong with it)."""
    from hostpool.base.config import load_file

    if hostpool_forms and isinstance(extra, dict):
        return extra, None
    if isinstance(extra, str) and extra.strip().startswith("@"):
        path = extra.strip()[1:]
        try:
            config = load_file(path, what="hicache_storage_backend_extra_config")
        except ConfigError as exc:
            return None, str(exc)
        if hostpool_forms:
            return config, None
        if config.get("allocator") == "shm":  # true, and what an operator needs to know
            return None, (
                f"{path} asks for allocator shm, but sglang's get_allocator_type reads "
                "only inline JSON: sglang's default allocator is used"
            )
        return None, None
    try:
        config = json.loads(extra)
    except Exception as exc:  # sglang ignores any failure here: so does its answer
        return None, f"{type(exc).__name__}: {exc}"
    if not isinstance(config, dict):
        return None, f"not a JSON object but {type(config).__name__}: {extra!r:.80}"
    return config, None


def answer_allocator_type(backend: Any, extra_config: Any, *, hostpool_forms: bool = False) -> str:
    """`allocator_type_rule`'s answer; its problem, if any, as a warning event."""
    answer, problem = allocator_type_rule(backend, extra_config, hostpool_forms=hostpool_forms)
    if problem is not None:
        events.warning(
            BAD_EXTRA_CONFIG,
            error=problem,
            answer=answer,
            meaning="sglang's answer: the extra config's allocator is ignored",
        )
    return answer


def get_allocator_type(server_args: Any) -> str:
    """hostpool's `get_allocator_type(server_args)` (`hostpool.get_allocator_type`):
    sglang's rule (`allocator_type_rule`) over an object or dict with sglang's
    `hicache_storage_backend` and `hicache_storage_backend_extra_config`. The extra config
    may also be a dict or `@path` to a .json/.toml/.yaml/.yml file. One that is malformed
    or unreadable gets the answer sglang gives ("dynamic") and a
    `hostpool.sglang.bad_extra_config` warning event, never an exception; a backend that
    is not a string is a ConfigError."""
    return answer_allocator_type(
        field_of(server_args, "hicache_storage_backend"),
        field_of(server_args, "hicache_storage_backend_extra_config"),
        hostpool_forms=True,
    )


def field_of(server_args: Any, name: str) -> Any:
    """`server_args.name`, or `server_args[name]` for a dict; None when absent."""
    if isinstance(server_args, dict):
        return server_args.get(name)
    return getattr(server_args, name, None)


HUGEPAGE_ENV = "SGLANG_HUGEPAGE_SIZE"  # sglang's knob for its mmap allocator


def mmap_options() -> dict[str, str]:
    """sglang's `SGLANG_HUGEPAGE_SIZE` (read per call, as sglang does) as hostpool options:
    `2MB`/`1GB` try hugetlb and fall back to normal pages (hostpool counts the fallback);
    anything else is sglang's warning and normal pages."""
    raw = os.environ.get(HUGEPAGE_ENV) or ""
    size = raw.strip().upper()
    if size in ("2MB", "1GB"):
        return {"hugepages": "prefer", "hugepage_size": size}
    if size:
        events.warning("hostpool.sglang.bad_hugepage_size", value=raw, expected="2MB or 1GB")
    return {}
