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
`hostpool.vllm.unknown_layout` warning; a record that cannot be made never stops vLLM
(`hostpool.vllm.untracked` warning).
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hostpool.base import events
from hostpool.integrations.importhook import PostImportHook
from hostpool.memory.region import Region

REGION_MODULE = "vllm.v1.kv_offload.cpu.shared_offload_region"
WORKER_MODULE = "vllm.v1.kv_offload.cpu.gpu_worker"
POOL = "vllm_offload"
REGION_ALLOCATOR = "vllm_shared_region"
TENSOR_ALLOCATOR = "vllm_torch"

# Region and owner ids of this module's records: a range of their own, below the ids
# hostpool's allocators (counting up from 1) and sglang's foreign owners (-1, -2, ...) use.
_ID_BASE = 1 << 48
_ids = itertools.count(1)

_lock = threading.RLock()
_installed = False
_hook: PostImportHook | None = None
# (class or module, attribute, original) put back by uninstall().
_patched: list[tuple[Any, str, Any]] = []
# vLLM's SharedOffloadRegion -> its record; vLLM's CPUOffloadingWorker -> owner id of
# its fallback tensors. Weak keys: hostpool keeps nothing of vLLM's alive.
_regions: weakref.WeakKeyDictionary[Any, VllmRegion] = weakref.WeakKeyDictionary()
_workers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_populating = threading.local()  # .state: the _Populate of the region __init__ on this thread


def installed() -> bool:
    return _installed


def install() -> None:
    """Record vLLM's offload memory in this process (now and for modules imported later).
    Idempotent."""
    global _installed, _hook
    with _lock:
        if _installed:
            return
        _installed = True
        _hook = PostImportHook(_is_target, _after_late_import)
        _hook.add()
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
    global _installed, _hook
    with _lock:
        if not _installed:
            return
        _installed = False
        if _hook is not None:
            _hook.remove()
        _hook = None
        for owner, attr, original in reversed(_patched):
            setattr(owner, attr, original)
        _patched.clear()
        owners = list(_workers.values())
        _workers.clear()
    for owner in owners:
        _release_owner(owner)


def _is_target(name: str) -> bool:
    return name in (REGION_MODULE, WORKER_MODULE)


def _after_late_import(module: types.ModuleType) -> None:
    with _lock:
        if _installed:
            _after_import(module)


def _after_import(module: types.ModuleType) -> None:
    if module.__name__ == REGION_MODULE:
        names = vars(module)
        cls = names.get("SharedOffloadRegion")
        chooser = names.get("_get_populate_write_fn")
        madvise = names.get("_madvise_populate_write")
        if _has(cls, "__init__", "cleanup") and callable(chooser) and callable(madvise):
            _patch(cls, "__init__", _region_init)
            _patch(cls, "cleanup", _region_cleanup)
            # The populate vLLM chose (MADV_POPULATE_WRITE or its per-page fallback), and
            # its time: read where vLLM picks it, so the record says what happened.
            _patch(module, "_get_populate_write_fn", functools.partial(_populate_chooser, madvise))
        else:
            events.warning("hostpool.vllm.unknown_layout", module=module.__name__)
    elif module.__name__ == WORKER_MODULE:
        cls = vars(module).get("CPUOffloadingWorker")
        if _has(cls, "__init__", "shutdown"):
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


# -- SharedOffloadRegion --------------------------------------------------------------
@dataclass(eq=False)
class VllmRegion(Region):
    """A `SharedOffloadRegion` as the ledger sees it: vLLM owns the fd and the mapping,
    hostpool holds weak references and the inode (nothing here opens, maps or closes).

    `fd` is vLLM's fd while it still names the region's inode; `open_fd_count()` is that
    fd plus mmap's internal dup while vLLM's mapping is open: what /proc/PID/fd shows.
    """

    source: weakref.ReferenceType[Any] | None = field(default=None, repr=False)
    mapping: weakref.ReferenceType[mmap.mmap] | None = field(default=None, repr=False)

    @property
    def fd(self) -> int | None:
        fd, _ = self._stat()
        return fd

    def _stat(self) -> tuple[int | None, int]:
        """(vLLM's fd, bytes the file holds) when the fd still names our inode."""
        source = self.source() if self.source is not None else None
        fd = getattr(source, "fd", None)
        if not isinstance(fd, int):
            return None, 0
        try:
            st = os.fstat(fd)
        except OSError:
            return None, 0
        if (st.st_dev, st.st_ino) != self.dev_ino:
            return None, 0  # closed by vLLM and the number reused: not ours to count
        return fd, min(st.st_blocks * 512, self.mapped_bytes)

    @property
    def mapped(self) -> bool:
        mm = self.mapping() if self.mapping is not None else None
        return mm is not None and not mm.closed

    def views_alive(self) -> bool:
        return self.mapped

    def mmap(self) -> None:
        """None: the mapping is vLLM's, never handed out by hostpool."""
        return None

    def open_fd_count(self) -> int:
        return self.scrape()[0]

    def borrow_fd(self) -> int | None:
        fd = self.fd
        if fd is None:
            return None
        dup = os.dup(fd)
        st = os.fstat(dup)
        if (st.st_dev, st.st_ino) != self.dev_ino:
            os.close(dup)
            return None
        return dup

    def resident_bytes(self) -> int:
        return self.scrape()[1]

    def scrape(self) -> tuple[int, int]:
        fd, resident = self._stat()
        return (fd is not None) + self.mapped, resident

    def close(self) -> bool:
        """Closes nothing (vLLM's `cleanup()` does); True once vLLM's mapping is closed."""
        return not self.mapped


@dataclass
class _Populate:
    """What vLLM's populate did inside one region constructor on this thread."""

    mode: str = "none"  # a creator-only joiner populates nothing
    seconds: float = 0.0
    waited: float = 0.0  # in vLLM's barrier: other ranks' time, not this allocation's


def _populate_chooser(
    madvise: Callable[..., None], original: Callable[..., Callable[..., None]]
) -> Callable[..., Callable[..., None]]:
    def _get_populate_write_fn(mmap_obj: Any) -> Callable[..., None]:
        chosen = original(mmap_obj)
        state: _Populate | None = getattr(_populating, "state", None)
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
        state = _Populate()
        if callable(kwargs.get("barrier")):  # vLLM passes it by name
            kwargs["barrier"] = _timed_barrier(kwargs["barrier"], state)
        outer = getattr(_populating, "state", None)
        _populating.state = state
        started = time.perf_counter()
        try:
            original(self, *args, **kwargs)
        finally:
            _populating.state = outer
        seconds = time.perf_counter() - started - state.waited
        try:
            _record_region(self, seconds, state)
        except Exception as exc:  # a record must never stop vLLM
            _untracked(exc)

    return __init__


def _timed_barrier(barrier: Callable[[], None], state: _Populate) -> Callable[[], None]:
    def timed() -> None:
        started = time.perf_counter()
        try:
            barrier()
        finally:
            state.waited += time.perf_counter() - started

    return timed


def _region_cleanup(original: Callable[..., None]) -> Callable[..., None]:
    def cleanup(self: Any) -> None:
        try:
            original(self)
        finally:
            with _lock:
                region = _regions.pop(self, None)
            if region is not None:
                from hostpool.core.ledger import get_ledger

                get_ledger().release(region.id)

    return cleanup


def _record_region(source: Any, seconds: float, populate: _Populate) -> None:
    from hostpool.core.ledger import get_ledger
    from hostpool.core.records import capture_stack

    fd = source.fd
    mm = source.mmap_obj
    if not isinstance(fd, int) or not isinstance(mm, mmap.mmap):
        raise TypeError("SharedOffloadRegion without an fd and a mapping")
    st = os.fstat(fd)
    nbytes = int(source.total_size_bytes)
    ledger = get_ledger()
    rid = -(_ID_BASE + next(_ids))
    region = VllmRegion(
        id=rid,
        pool=POOL,
        kind="shm",
        backend="devshm",
        name=os.path.basename(str(source.mmap_path)),
        requested_bytes=nbytes,
        mapped_bytes=nbytes,
        page_size=mmap.PAGESIZE,
        address=int(source.base_tensor.data_ptr()),
        populate_mode=populate.mode,
        populate_seconds=populate.seconds,
        hugepage_fallbacks=(),
        thp_advised=False,
        seals=0,
        numa_node=None,
        dev_ino=(st.st_dev, st.st_ino),
        source=weakref.ref(source),
        mapping=weakref.ref(mm),
    )
    # The mapping goes with vLLM's mmap object. Its end is explicit when vLLM's cleanup()
    # ran (the region object lives on with `mmap_obj = None`), else a leak: the object was
    # collected (its fd stays open: vLLM closes it only in cleanup()).
    gone = functools.partial(_mapping_gone, ledger.unmapped_callback(), weakref.ref(source), rid)
    weakref.finalize(mm, gone).atexit = False
    with _lock:
        _regions[source] = region
    ledger.add_pool(POOL)
    ledger.record(
        region,
        allocator=REGION_ALLOCATOR,
        owner=rid,
        stack=capture_stack() if ledger.track_stacks else None,
        seconds=seconds,
        dims=(nbytes,),
        dtype="torch.int8",
    )
    events.info(
        "hostpool.vllm.recorded",
        pool=POOL,
        allocator=REGION_ALLOCATOR,
        bytes=nbytes,
        name=region.name,
        fd=fd,
        rank=getattr(source, "rank", None),
        seconds=round(seconds, 6),
    )


def _mapping_gone(
    notify: Callable[..., None], source_ref: weakref.ReferenceType[Any], region_id: int
) -> None:
    # Finalizer (any thread, inside GC): no lock, no reference to the record.
    source = source_ref()
    cleaned = source is not None and getattr(source, "mmap_obj", True) is None
    notify(region_id, "explicit" if cleaned else "finalizer")


def _untracked(exc: BaseException) -> None:
    events.warning(
        "hostpool.vllm.untracked",
        pool=POOL,
        error=f"{type(exc).__name__}: {exc}",
        effect="vLLM runs unchanged; this region is not in hostpool's ledger",
    )


# -- CPUOffloadingWorker's torch.zeros fallback --------------------------------------
def _worker_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        owner = -(_ID_BASE + next(_ids))
        try:
            with _zeros_mode_type()(owner):
                original(self, *args, **kwargs)
        except BaseException:
            _release_owner(owner)  # vLLM's constructor failed and dropped them
            raise
        with _lock:
            if _installed:
                _workers[self] = owner
                return
        _release_owner(owner)  # uninstalled meanwhile: nothing will watch shutdown()

    return __init__


def _worker_shutdown(original: Callable[..., None]) -> Callable[..., None]:
    def shutdown(self: Any) -> None:
        try:
            original(self)
        finally:
            with _lock:
                owner = _workers.pop(self, None)
            if owner is not None:
                _release_owner(owner)

    return shutdown


def _release_owner(owner: int) -> None:
    from hostpool.core.ledger import get_ledger

    ledger = get_ledger()
    for region in ledger.regions(owner=owner):
        ledger.release(region.id)


@functools.cache
def _zeros_mode_type() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    class ZerosMode(TorchFunctionMode):
        """While vLLM's worker constructor runs on this thread, each CPU tensor
        `torch.zeros` makes is recorded. A torch function mode is thread-local and
        scoped to the `with`: torch stays unchanged for everyone else."""

        def __init__(self, owner: int) -> None:
            super().__init__()
            self.owner = owner

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            result = func(*args, **(kwargs or {}))
            if (
                func is torch.zeros
                and isinstance(result, torch.Tensor)
                and result.device.type == "cpu"
                and result.numel()
            ):
                try:
                    return _record_tensor(result, self.owner)
                except Exception as exc:  # a record must never stop vLLM
                    _untracked(exc)
            return result

    return ZerosMode


def _record_tensor(tensor: Any, owner: int) -> Any:
    from hostpool.core.ledger import get_ledger
    from hostpool.core.records import capture_stack
    from hostpool.memory.foreign import adopt

    ledger = get_ledger()
    region, view = adopt(tensor, POOL, ledger.unmapped_callback())
    ledger.add_pool(POOL)
    ledger.record(
        region,
        allocator=TENSOR_ALLOCATOR,
        owner=owner,
        stack=capture_stack() if ledger.track_stacks else None,
        seconds=0.0,
        dims=tuple(view.shape),
        dtype=str(view.dtype),
    )
    events.info(
        "hostpool.vllm.recorded",
        pool=POOL,
        allocator=TENSOR_ALLOCATOR,
        bytes=region.mapped_bytes,
    )
    return view
