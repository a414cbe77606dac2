"""sglang on hostpool, with no change to sglang's source.

sglang (0.5.23) picks its host allocator in `pool_host/common.py` and imports the entry
points *by name* into many modules. `install()` replaces every module attribute that *is*
one of sglang's originals, in the modules already imported and, through an import hook,
in every sglang module imported later, so a new module importing these names is covered:

- `get_allocator_from_storage`: sglang's own dispatch (fallbacks and warnings included);
  where it picks sglang's own `HostTensorAllocator` / `ShmHostTensorAllocator`, hostpool's
  stand-ins are handed out instead: subclasses of sglang's base allocator class whose
  memory comes from hostpool's memory layer (memfd / anonymous mmap), every region in the
  ledger. `fd`/`mm` are the first of `fds`/`mms` and stay valid for the allocator's life,
  as in sglang. Allocators hostpool does not own (mooncake, tensorcast, mori, unknown)
  stay sglang's, and their tensors are recorded as *foreign* regions (bytes, pool, kind;
  no fd).
- `alloc_shm` / `alloc_mmap` everywhere, and the two class names where a module imports
  them to construct allocators (sglang's state capturer); not where sglang's own
  subclasses look the base class up (the module that defines it, and a package that
  re-exports it in `__all__`): mooncake's, UMBP's and tensorcast's allocator classes are
  imported lazily, after `install()`, and must inherit sglang's class, not hostpool's.
- `get_allocator_type`: sglang's answer, also with `server_args`; a malformed extra config
  adds a `hostpool.sglang.bad_extra_config` warning event and never raises. The rule is
  `allocator_type_rule` in `rules`, here once (also `hostpool.get_allocator_type`).
- `HostKVCache.destroy()` (and each override): after sglang's teardown the pool's regions
  are released *explicitly*; the pool's label (`pool_label`, `pool_name`) is the pool.
- with `PROMETHEUS_MULTIPROC_DIR` set, the multiprocess publisher starts in each process
  at its first tracked allocation, so hostpool's series appear on sglang's `/metrics`.

Everything else sglang imports from these modules stays sglang's own. `uninstall()` puts
every original back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hostpool._lazy import lazy_exports
from hostpool.integrations.sglang.patching import install, installed, is_sglang, uninstall
from hostpool.integrations.sglang.rules import BAD_EXTRA_CONFIG, get_allocator_type

# alloc_shm / alloc_mmap need torch: loaded on first use, not by the `.pth` hook.
_EXPORTS = {
    "alloc_shm": "hostpool.integrations.sglang.shapes",
    "alloc_mmap": "hostpool.integrations.sglang.shapes",
}
__all__ = [
    "BAD_EXTRA_CONFIG",
    "alloc_mmap",
    "alloc_shm",
    "get_allocator_type",
    "install",
    "installed",
    "is_sglang",
    "uninstall",
]

if TYPE_CHECKING:
    from hostpool.integrations.sglang.shapes import alloc_mmap, alloc_shm

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
