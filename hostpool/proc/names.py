"""Names of shared-memory objects as /proc shows them: the known prefixes, what a
name says about its pool and owner, and the kind of object a path is.

Names: `<prefix><pool>.<pid>.<seq>[.<random>]` (hostpool, and hostpool's sglang
compatibility prefix). sglang's own raw names (`sglang_host_pool_<hex>[.mmap]`) carry no
pool: they are grouped under pool `-`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

HOSTPOOL_PREFIX: Final = "hostpool."
SGLANG_PREFIX: Final = "sglang_host_pool_"
KNOWN_PREFIXES: Final[tuple[str, ...]] = (HOSTPOOL_PREFIX, SGLANG_PREFIX)
NO_POOL: Final = "-"

Kind = Literal["memfd", "file", "anon"]

_DELETED: Final = " (deleted)"
_MEMFD: Final = "/memfd:"
_DEVSHM: Final = "/dev/shm/"
_ANON_TAGS: Final = ("[anon:", "[anon_shmem:")
# `<pool>.<pid>.<seq>` and the fallback file's `.<random>`; pools match [A-Za-z0-9_-]{1,64}.
_STRUCTURED = re.compile(r"([A-Za-z0-9_-]{1,64})\.(\d+)\.(\d+)(?:\.[A-Za-z0-9_-]+)?")


@dataclass(frozen=True, slots=True)
class ShmName:
    """A shared-memory object's name and what it says about its owner."""

    name: str
    prefix: str  # the (longest) requested prefix it starts with
    pool: str  # NO_POOL when the name carries none
    owner_pid: int | None = None  # the pid in the name: the creator, not necessarily a holder
    seq: int | None = None


def parse_name(name: str, prefixes: Sequence[str] = KNOWN_PREFIXES) -> ShmName | None:
    """The pool and owner encoded in `name`, or None when no prefix matches.

    The pool is read after the known family prefix (`hostpool.`, `sglang_host_pool_`)
    even when a narrower prefix such as `hostpool.kv` selected the name.
    """
    matched = ""
    for prefix in prefixes:
        if name.startswith(prefix) and len(prefix) > len(matched):
            matched = prefix
    if not matched and "" not in prefixes:
        return None
    family = next((f for f in KNOWN_PREFIXES if name.startswith(f)), matched)
    m = _STRUCTURED.fullmatch(name, len(family))
    if m is None:
        return ShmName(name, matched, NO_POOL)
    return ShmName(name, matched, m.group(1), int(m.group(2)), int(m.group(3)))


def classify_path(path: str) -> tuple[Kind, str] | None:
    """(kind, object name) for a /proc fd link target or maps path that may be shm."""
    if path.startswith(_MEMFD):
        return "memfd", path[len(_MEMFD) :].removesuffix(_DELETED)
    if path.startswith(_DEVSHM):
        return "file", path[len(_DEVSHM) :].removesuffix(_DELETED)
    if path.endswith(_DELETED) and path.startswith("/"):
        # a fallback file in another `fallback_dir`: unlinked at once, so always deleted
        return "file", path.removesuffix(_DELETED).rpartition("/")[2]
    for tag in _ANON_TAGS:
        if path.startswith(tag) and path.endswith("]"):
            return "anon", path[len(tag) : -1]
    return None
