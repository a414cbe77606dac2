"""`HOSTPOOL_INSTRUMENT=vllm`: vLLM's own KV offload memory, recorded in the ledger.

A stock `--kv-offloading-size N --kv-offloading-backend native` deployment keeps making its
memory exactly as vLLM does (other tensor-parallel ranks find the shared region by path);
hostpool only records what vLLM made and when it let go:

- `SharedOffloadRegion` (`v1/kv_offload/cpu/shared_offload_region.py`, vLLM 0.32: a
  `/dev/shm/vllm_offload_{engine_id}.mmap` file, `MAP_SHARED`, `MADV_POPULATE_WRITE`,
  unlinked after a barrier): once vLLM's own `__init__` has returned, the region is a
  ledger record of pool `vllm_offload`, allocator `vllm_shared_region`, kind `shm`,
  backend `devshm`, its bytes, address and the `(st_dev, st_ino)` of vLLM's fd. vLLM's
  `cleanup()` is the explicit release (`hostpool_releases_total{how="explicit"}`); a
  region whose mapping is collected without `cleanup()` ends as `finalizer` (the leak
  signal). hostpool opens, maps and closes nothing of it: the fd and the mapping stay
  vLLM's, so `hostpool_open_fds` counts what /proc shows for it (vLLM's fd and mmap's
  dup), each number checked against the inode before it is trusted.
- the `torch.zeros(..., pin_memory=...)` fallback of `CPUOffloadingWorker` (platforms
  without the shared region): each CPU tensor it makes is recorded as a foreign region
  (allocator `vllm_torch`, no fd) and vLLM's worker gets a tensor over the same memory.
  The worker's `shutdown()`, or its constructor failing, releases them explicitly.

Patched by identity, on the classes themselves: vLLM imports `SharedOffloadRegion` by
name into several modules (the spec modules lazily, through its spec factory), and a
method patched on the class reaches every one of them, whenever it was imported. An
import hook patches the two defining modules when they load after `install()` (the `.pth`
hook installs before vLLM is imported). Nothing else of vLLM changes; `uninstall()` puts
every original back. A vLLM whose layout differs from 0.32's is left alone, with one
`hostpool.vllm.unknown_layout` warning, and so is a vLLM outside the versions these
internals were read from (`internals.GATE`: one `hostpool.untested_version` warning); a
record that cannot be made never stops vLLM (`hostpool.vllm.untracked` warning). Which
of vLLM's internals this relies on is `internals`' to say.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from hostpool.base import events
from hostpool.integrations.importhook import Switch
from hostpool.integrations.vllm import internals as vllm_internals
from hostpool.integrations.vllm.recording import (
    Populate,
    VllmRegion,
    next_owner_id,
    record_region,
    release_owner,
    untracked,
    zeros_mode_type,
)

REGION_MODULE = vllm_internals.REGION_MODULE
WORKER_MODULE = vllm_internals.WORKER_MODULE
_Entry = TypeVar("_Entry")


# (class or module, attribute, original) put back by uninstall().
_patched: list[tuple[Any, str, Any]] = []
# vLLM's SharedOffloadRegion -> its record; vLLM's CPUOffloadingWorker -> owner id of
# its fallback tensors. Weak keys: hostpool keeps nothing of vLLM's alive.
_regions: weakref.WeakKeyDictionary[Any, VllmRegion] = weakref.WeakKeyDictionary()
_workers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_populating = threading.local()  # .state: the Populate of the region __init__ on this thread


def installed() -> bool:
    return _switch.installed


def install() -> None:
    """Record vLLM's offload memory in this process (now and for modules imported later).
    Idempotent."""
    with _switch.lock:
        if not _switch.turn_on():
            return
        for name in (REGION_MODULE, WORKER_MODULE):
            module = sys.modules.get(name)
            if isinstance(module, types.ModuleType):
                _after_import(module)


def uninstall() -> None:
    """Restore every patched attribute to vLLM's original and remove the import hook.

    Regions recorded meanwhile stay in the ledger: a `SharedOffloadRegion` still ends as
    `explicit` when vLLM's `cleanup()` closed its mapping. The fallback tensors of a
    worker still alive are released now (explicitly: nothing would watch its shutdown);
    their bytes stay visible while vLLM's views map them.
    """
    with _switch.lock:
        if not _switch.turn_off():
            return
        for owner, attr, original in reversed(_patched):
            setattr(owner, attr, original)
        _patched.clear()
        owners = list(_workers.values())
        _workers.clear()
    for owner in owners:
        release_owner(owner)


def _is_target(name: str) -> bool:
    return name in (REGION_MODULE, WORKER_MODULE)


def _after_import(module: types.ModuleType) -> None:
    if not vllm_internals.supported():
        return  # vLLM stays as it is (the gate warned once)
    names = vars(module)
    if module.__name__ == REGION_MODULE:
        cls = names.get(vllm_internals.REGION_CLASS)
        chooser = names.get(vllm_internals.POPULATE_CHOOSER)
        madvise = names.get(vllm_internals.POPULATE_MADVISE)
        if _has(cls, *vllm_internals.REGION_METHODS) and callable(chooser) and callable(madvise):
            _patch(cls, "__init__", _region_init)
            _patch(cls, "cleanup", _region_cleanup)
            # The populate vLLM chose (MADV_POPULATE_WRITE or its per-page fallback), and
            # its time: read where vLLM picks it, so the record says what happened.
            chooser_patch = functools.partial(_populate_chooser, madvise)
            _patch(module, vllm_internals.POPULATE_CHOOSER, chooser_patch)
        else:
            events.warning("hostpool.vllm.unknown_layout", module=module.__name__)
    elif module.__name__ == WORKER_MODULE:
        cls = names.get(vllm_internals.WORKER_CLASS)
        if _has(cls, *vllm_internals.WORKER_METHODS):
            _patch(cls, "__init__", _worker_init)
            _patch(cls, "shutdown", _worker_shutdown)
        else:
            events.warning("hostpool.vllm.unknown_layout", module=module.__name__)


def _has(cls: Any, *methods: str) -> bool:
    return isinstance(cls, type) and all(callable(cls.__dict__.get(m)) for m in methods)


def _patch(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = vars(owner)[attr]
    if getattr(original, "hostpool_vllm", False):
        return  # already ours (a module executed twice)
    wrapper = functools.wraps(original)(make(original))
    wrapper.hostpool_vllm = True  # type: ignore[attr-defined]
    setattr(owner, attr, wrapper)
    _patched.append((owner, attr, original))


def _populate_chooser(
    madvise: Callable[..., None], original: Callable[..., Callable[..., None]]
) -> Callable[..., Callable[..., None]]:
    def _get_populate_write_fn(mmap_obj: Any) -> Callable[..., None]:
        chosen = original(mmap_obj)
        state: Populate | None = getattr(_populating, "state", None)
        if state is None:
            return chosen
        state.mode = "madvise" if chosen is madvise else "touch"

        def populate(mm: Any, offset: int, length: int) -> None:
            started = time.perf_counter()
            try:
                chosen(mm, offset, length)
            finally:
                state.seconds += time.perf_counter() - started

        return populate

    return _get_populate_write_fn


def _region_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        state = Populate()
        barrier = kwargs.get(vllm_internals.BARRIER_KEYWORD)  # vLLM passes it by name
        if callable(barrier):
            kwargs[vllm_internals.BARRIER_KEYWORD] = _timed_barrier(barrier, state)
        outer = getattr(_populating, "state", None)
        _populating.state = state
        started = time.perf_counter()
        try:
            original(self, *args, **kwargs)
        finally:
            _populating.state = outer
        seconds = time.perf_counter() - started - state.waited
        try:
            region = record_region(self, seconds, state)
        except Exception as exc:  # a record must never stop vLLM
            untracked(exc)
            return
        with _switch.lock:
            _regions[self] = region

    return __init__


def _timed_barrier(barrier: Callable[[], None], state: Populate) -> Callable[[], None]:
    def timed() -> None:
        started = time.perf_counter()
        try:
            barrier()
        finally:
            state.waited += time.perf_counter() - started

    return timed


def _ending(
    table: weakref.WeakKeyDictionary[Any, _Entry], end: Callable[[_Entry], None]
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The `_patch` maker for a method that ends a vLLM object (`cleanup`, `shutdown`):
    vLLM's original runs first; then, whatever it raised, the object's entry leaves `table`
    (under the switch's lock) and `end(entry)` releases what hostpool recorded for it."""

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def ended(self: Any) -> None:
            try:
                original(self)
            finally:
                with _switch.lock:
                    entry = table.pop(self, None)
                if entry is not None:
                    end(entry)

        return ended

    return make


def _release_region(region: VllmRegion) -> None:
    from hostpool.core.ledger import get_ledger

    get_ledger().release(region.facts.id)


_region_cleanup = _ending(_regions, _release_region)


# -- CPUOffloadingWorker's torch.zeros fallback --------------------------------------
def _worker_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        owner = next_owner_id()
        try:
            with zeros_mode_type()(owner):
                original(self, *args, **kwargs)
        except BaseException:
            release_owner(owner)  # vLLM's constructor failed and dropped them
            raise
        with _switch.lock:
            if _switch.installed:
                _workers[self] = owner
                return
        release_owner(owner)  # uninstalled meanwhile: nothing will watch shutdown()

    return __init__


_worker_shutdown = _ending(_workers, release_owner)


_switch = Switch(_is_target, _after_import)
