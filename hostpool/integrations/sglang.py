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
  `allocator_type_rule`, here once: `hostpool.get_allocator_type` is this module's.
- `HostKVCache.destroy()` (and each override): after sglang's teardown the pool's regions
  are released *explicitly*; the pool's label (`pool_label`, `pool_name`) is the pool.
- with `PROMETHEUS_MULTIPROC_DIR` set, the multiprocess publisher starts in each process
  at its first tracked allocation, so hostpool's series appear on sglang's `/metrics`.

Everything else sglang imports from these modules stays sglang's own. `uninstall()` puts
every original back.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from hostpool import events
from hostpool.errors import ConfigError
from hostpool.integrations.importhook import PostImportHook, in_package

COMMON = "sglang.srt.mem_cache.pool_host.common"
MMAP = "sglang.srt.mem_cache.storage.mmap.mmap_allocator"
BASE = "sglang.srt.mem_cache.pool_host.base"
DEFAULT_POOL = "default"
FOREIGN_KINDS = ("mooncake", "tensorcast", "mori")
_POOL_CHARS = re.compile(r"[^A-Za-z0-9_-]")
_LABEL_DEPTH = 40  # frames searched for the host pool being built

_lock = threading.RLock()
_installed = False
_hook: PostImportHook | None = None
# id(original) -> (original, replacement); built when sglang's modules load.
_replacements: dict[int, tuple[Any, Any]] = {}
# (module, attribute, original) and (class, "destroy", original) put back by uninstall().
_patched_attrs: list[tuple[types.ModuleType, str, Any]] = []
_patched_classes: list[tuple[type, str, Any]] = []
_host_kv_cache: type | None = None


def installed() -> bool:
    return _installed


def install() -> None:
    """Patch sglang in this process (now and for modules imported later). Idempotent."""
    global _installed, _hook
    with _lock:
        if _installed:
            return
        _installed = True
        _hook = PostImportHook(_is_sglang, _after_late_import)
        _hook.add()
        # The modules that define the originals first, then everything that imported them.
        first = [n for n in (MMAP, COMMON, BASE) if n in sys.modules]
        rest = sorted(n for n in list(sys.modules) if _is_sglang(n) and n not in first)
        for name in first + rest:
            module = sys.modules.get(name)
            if isinstance(module, types.ModuleType):
                _after_import(module)


def uninstall() -> None:
    """Restore every patched attribute to sglang's original and remove the import hook."""
    global _installed, _hook
    with _lock:
        if not _installed:
            return
        _installed = False
        if _hook is not None:
            _hook.remove()
        _hook = None
        originals = {id(rep): orig for orig, rep in _replacements.values()}
        # Modules imported while installed hold replacements too: put originals back by
        # identity everywhere, not only where install() wrote.
        for name in list(sys.modules):
            module = sys.modules.get(name)
            if not (_is_sglang(name) and isinstance(module, types.ModuleType)):
                continue
            for attr, value in list(vars(module).items()):
                original = originals.get(id(value))
                if original is not None:
                    setattr(module, attr, original)
        for module, attr, original in _patched_attrs:
            setattr(module, attr, original)
        for cls, attr, original in _patched_classes:
            setattr(cls, attr, original)
        _patched_attrs.clear()
        _patched_classes.clear()


_is_sglang = in_package("sglang")


# -- modules as they load ---------------------------------------------------------------
def _after_late_import(module: types.ModuleType) -> None:
    with _lock:
        if _installed:
            _after_import(module)


def _after_import(module: types.ModuleType) -> None:
    global _host_kv_cache
    if module.__name__ == MMAP:
        _build_mmap_replacements(module)
    elif module.__name__ == COMMON:
        _build_common_replacements(module)
    elif module.__name__ == BASE and _host_kv_cache is None:
        _host_kv_cache = getattr(module, "HostKVCache", None)
    for attr, value in list(vars(module).items()):
        pair = _replacements.get(id(value))
        if pair is not None and pair[0] is value and not _exports(module, attr, value):
            setattr(module, attr, pair[1])
            _patched_attrs.append((module, attr, value))
    # ALLOC_MEMORY_FUNCS: entries already materialised by the defaultdict.
    table = vars(module).get("ALLOC_MEMORY_FUNCS")
    if isinstance(table, dict):
        for key, value in list(table.items()):
            pair = _replacements.get(id(value))
            if pair is not None and pair[0] is value:
                table[key] = pair[1]
    _wrap_destroys(module)


def _replace(original: Any, replacement: Any) -> None:
    _replacements[id(original)] = (original, replacement)


def _exports(module: types.ModuleType, attr: str, value: Any) -> bool:
    """Whether `module` is where sglang's code imports the class `value` from to subclass
    it: the module that defines it, or a package re-exporting it in `__all__`. The name
    stays sglang's there, so a subclass defined later (mooncake's, UMBP's, tensorcast's
    allocators, imported lazily) inherits sglang's class whether or not hostpool is on."""
    if not isinstance(value, type):
        return False
    return value.__module__ == module.__name__ or attr in getattr(module, "__all__", ())


# -- pool labels ------------------------------------------------------------------------
def pool_name(label: object) -> str:
    """sglang's free-text label as a hostpool pool name ([A-Za-z0-9_-]{1,64})."""
    cleaned = _POOL_CHARS.sub("_", str(label))[:64]
    return cleaned or DEFAULT_POOL


def _class_label(cls: type) -> str:
    name = cls.__name__
    for suffix in ("TokenToKVPoolHost", "PoolHost", "HostPool", "Host"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)].lower()
    return name.lower()


def _label_of(owner: object) -> str:
    state = getattr(owner, "__dict__", {})
    label = state.get("pool_label") or state.get("pool_name")
    return pool_name(label) if label else pool_name(_class_label(type(owner)))


def current_pool(allocator: object | None = None) -> str:
    """The label of the sglang host pool being built on this thread's stack.

    sglang never hands the label to its allocator; the pool object is on the stack (it
    is building its buffers), so find it: the frame whose `self` holds `allocator`, else
    the nearest host pool.
    """
    frame = sys._getframe(1)
    fallback: object | None = None
    for _ in range(_LABEL_DEPTH):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            break
        me = frame.f_locals.get("self")
        if me is None or me is allocator:
            continue
        state = getattr(me, "__dict__", None)
        if not isinstance(state, dict):
            continue
        if allocator is not None and state.get("allocator") is allocator:
            return _label_of(me)
        if fallback is None and (
            "pool_label" in state
            or "pool_name" in state
            or (_host_kv_cache is not None and isinstance(me, _host_kv_cache))
        ):
            fallback = me
    return _label_of(fallback) if fallback is not None else DEFAULT_POOL


# -- replacements for pool_host/common.py and storage/mmap ------------------------------
HUGEPAGE_ENV = "SGLANG_HUGEPAGE_SIZE"  # sglang's knob for its mmap allocator


def mmap_options() -> dict[str, str]:
    """sglang's `SGLANG_HUGEPAGE_SIZE` (read per call, as sglang does) as hostpool options:
    `2MB`/`1GB` try hugetlb and fall back to normal pages (hostpool counts the fallback);
    anything else is sglang's warning and normal pages."""
    import os

    raw = os.environ.get(HUGEPAGE_ENV) or ""
    size = raw.strip().upper()
    if size in ("2MB", "1GB"):
        return {"hugepages": "prefer", "hugepage_size": size}
    if size:
        events.warning("hostpool.sglang.bad_hugepage_size", value=raw, expected="2MB or 1GB")
    return {}


def _build_mmap_replacements(module: types.ModuleType) -> None:
    original_shm = vars(module).get("alloc_shm")
    original_mmap = vars(module).get("alloc_mmap")
    if original_shm is not None and id(original_shm) not in _replacements:

        def alloc_shm(dims: tuple[int, ...], dtype: Any) -> tuple[Any, int, Any]:
            """sglang's `alloc_shm` on hostpool: (tensor, fd, mm); the fd is the caller's."""
            from hostpool import allocators

            result = allocators.alloc_shm(dims, dtype, pool=current_pool())
            _started()
            return result

        alloc_shm.__wrapped__ = original_shm  # type: ignore[attr-defined]
        _replace(original_shm, alloc_shm)
    if original_mmap is not None and id(original_mmap) not in _replacements:

        def alloc_mmap(dims: tuple[int, ...], dtype: Any) -> Any:
            """sglang's `alloc_mmap` on hostpool: the tensor owns its mapping."""
            from hostpool import allocators

            tensor = allocators.alloc_mmap(dims, dtype, pool=current_pool(), **mmap_options())
            _started()
            return tensor

        alloc_mmap.__wrapped__ = original_mmap  # type: ignore[attr-defined]
        _replace(original_mmap, alloc_mmap)


def _build_common_replacements(common: types.ModuleType) -> None:
    names = vars(common)
    base = names.get("HostTensorAllocator")
    shm_base = names.get("ShmHostTensorAllocator")
    factory = names.get("get_allocator_from_storage")
    type_rule = names.get("get_allocator_type")
    if base is None or shm_base is None or factory is None or type_rule is None:
        events.warning("hostpool.sglang.unknown_layout", module=COMMON)
        return
    if id(factory) in _replacements:
        return
    default_cls, shm_cls = _allocator_classes(base)
    _replace(base, default_cls)
    _replace(shm_base, shm_cls)
    tracked = (default_cls, shm_cls)

    def get_allocator_from_storage(allocator_type: Any) -> Any:
        """sglang's dispatch. Where it picks one of sglang's own two classes (its
        fallbacks included), hostpool's stand-in; any other allocator stays sglang's and
        its tensors are tracked as foreign."""
        allocator = factory(allocator_type)
        # Exact types: a subclass of sglang's classes is someone else's allocator.
        if type(allocator) is base:
            return default_cls()
        if type(allocator) is shm_base:
            return shm_cls()  # sglang's has made nothing yet: no fd to close
        if not isinstance(allocator, tracked):
            _track_foreign(allocator, str(allocator_type))
        return allocator

    hip_check = names.get("_uses_hip_owned_host_memory")
    if callable(hip_check):

        def uses_hip_owned_host_memory(pin_memory: bool, allocator: Any) -> bool:
            """sglang's ROCm check (`type(allocator) is HostTensorAllocator`), answering
            for hostpool's default allocator as for sglang's own."""
            if type(allocator) is default_cls:
                allocator = base()
            return bool(hip_check(pin_memory=pin_memory, allocator=allocator))

        uses_hip_owned_host_memory.__wrapped__ = hip_check  # type: ignore[attr-defined]
        _replace(hip_check, uses_hip_owned_host_memory)

    def get_allocator_type(server_args: Any = None) -> str:
        """sglang's answer (`allocator_type_rule`): from its published config, or from
        `server_args`; a malformed extra config is sglang's answer plus a warning event."""
        source = names["get_memory"]() if server_args is None else server_args
        return answer_allocator_type(
            _field(source, "hicache_storage_backend"),
            _field(source, "hicache_storage_backend_extra_config"),
        )

    get_allocator_from_storage.__wrapped__ = factory  # type: ignore[attr-defined]
    get_allocator_type.__wrapped__ = type_rule  # type: ignore[attr-defined]
    _replace(factory, get_allocator_from_storage)
    _replace(type_rule, get_allocator_type)


# -- get_allocator_type: one rule ------------------------------------------------------
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
    from hostpool.config import load_file

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
        _field(server_args, "hicache_storage_backend"),
        _field(server_args, "hicache_storage_backend_extra_config"),
        hostpool_forms=True,
    )


def _field(server_args: Any, name: str) -> Any:
    if isinstance(server_args, dict):
        return server_args.get(name)
    return getattr(server_args, name, None)


def _allocator_classes(base: type) -> tuple[type, type]:
    """Subclasses of sglang's base allocator class (its isinstance checks keep working)."""
    from hostpool import allocators

    class HostTensorAllocator(base):  # type: ignore[misc]
        """sglang's default host allocator on hostpool: anonymous memory, tracked."""

        hostpool_kind = "mmap"

        def __init__(self) -> None:
            super().__init__()
            self.hostpool_allocator: allocators.HostTensorAllocator | None = None

        def allocate(self, dims: tuple[int, ...], dtype: Any, device: str) -> Any:
            assert device == "cpu", (
                f"{type(self).__name__} only supports CPU allocations; got device={device!r}"
            )
            self.dtype = dtype
            self.dims = dims
            tensor = self._hostpool(current_pool(self)).allocate(dims, dtype)
            self._made(tensor)
            _started()
            return tensor

        def _hostpool(self, pool: str) -> allocators.HostTensorAllocator:
            if self.hostpool_allocator is None:
                # Retaining: the pool's destroy() releases; a pool dropped without it
                # is the leak signal (`finalizer`), not a tensor's normal end.
                self.hostpool_allocator = allocators.create_allocator(
                    self.hostpool_kind, pool=pool, retain=True, **mmap_options()
                )
            return self.hostpool_allocator

        def _made(self, tensor: Any) -> None:
            """Hook for the shm allocator's fds/mms."""

        def close(self) -> None:
            """Release every region explicitly (sglang's `destroy()` calls this)."""
            if self.hostpool_allocator is not None:
                self.hostpool_allocator.close()

    class ShmHostTensorAllocator(HostTensorAllocator):
        """sglang's shm allocator on hostpool memfds: `fds`/`mms` hold every allocation
        for the allocator's life, `fd`/`mm` are the first. Collected without `destroy()`:
        its regions go through the ledger's finalizer (the leak signal); no fd is closed
        behind the ledger's back. It does not inherit sglang's shm class, whose `__del__`
        closes the fds (the ledger's own); sglang's dispatch hands out this one instead
        (and install() names it where sglang's state capturer constructs allocators)."""

        hostpool_kind = "shm"

        def __init__(self) -> None:
            HostTensorAllocator.__init__(self)
            self.fds: list[int] = []
            self.mms: list[Any] = []

        def _hostpool(self, pool: str) -> allocators.HostTensorAllocator:
            if self.hostpool_allocator is None:
                self.hostpool_allocator = allocators.ShmHostTensorAllocator(pool, retain=True)
            return self.hostpool_allocator

        def _made(self, tensor: Any) -> None:
            hp = self.hostpool_allocator
            assert isinstance(hp, allocators.ShmHostTensorAllocator)
            self.fds = hp.fds
            self.mms = hp.mms

        @property
        def fd(self) -> int | None:
            return self.fds[0] if self.fds else None

        @property
        def mm(self) -> Any:
            return self.mms[0] if self.mms else None

        def close(self) -> None:
            self.fds = []
            self.mms = []
            super().close()

    HostTensorAllocator.__qualname__ = HostTensorAllocator.__name__
    ShmHostTensorAllocator.__qualname__ = ShmHostTensorAllocator.__name__
    HostTensorAllocator.__module__ = __name__
    ShmHostTensorAllocator.__module__ = __name__
    return HostTensorAllocator, ShmHostTensorAllocator


# -- foreign allocators ----------------------------------------------------------------
def _track_foreign(allocator: Any, kind: str) -> None:
    """Wrap `allocator.allocate` on the instance (its type stays sglang's): each tensor it
    makes is recorded as a foreign region of the pool being built."""
    original = allocator.allocate
    if getattr(original, "hostpool_foreign", False):
        return
    kind = pool_name(kind if kind in FOREIGN_KINDS else type(allocator).__name__)
    owner = _ForeignOwner(kind)

    def allocate(dims: Any, dtype: Any, device: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
        tensor = original(dims, dtype, device, *args, **kwargs)
        if getattr(tensor, "device", None) is None or tensor.device.type != "cpu":
            return tensor
        return owner.record(tensor, current_pool(allocator))

    allocate.hostpool_foreign = True  # type: ignore[attr-defined]
    allocator.allocate = allocate
    allocator.hostpool_foreign_owner = owner


class _ForeignOwner:
    """The ledger owner of one foreign allocator's regions (released by destroy())."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.id = -next(_foreign_ids)  # allocators count up from 1: no clash

    def record(self, tensor: Any, pool: str) -> Any:
        from hostpool.lifecycle import get_ledger
        from hostpool.memory.foreign import adopt

        ledger = get_ledger()
        region, view = adopt(tensor, pool, ledger.unmapped_callback())
        ledger.add_pool(pool)
        ledger.record(
            region,
            allocator=self.kind,
            owner=self.id,
            stack=None,
            seconds=0.0,
            dims=tuple(view.shape),
            dtype=str(view.dtype),
        )
        _started()
        return view

    def close(self) -> None:
        from hostpool.lifecycle import get_ledger

        ledger = get_ledger()
        for region in ledger.regions(owner=self.id):
            ledger.release(region.id)


_foreign_ids = iter(range(1, 1 << 62))


# -- explicit release on destroy() -----------------------------------------------------
def _wrap_destroys(module: types.ModuleType) -> None:
    if _host_kv_cache is None:
        return
    for value in list(vars(module).values()):
        if not (
            isinstance(value, type)
            and value.__module__ == module.__name__
            and issubclass(value, _host_kv_cache)
        ):
            continue
        original = value.__dict__.get("destroy")
        if original is None or getattr(original, "hostpool_wrapped", False):
            continue
        setattr(value, "destroy", _destroying(original))  # noqa: B010
        _patched_classes.append((value, "destroy", original))


def _destroying(original: Callable[..., Any]) -> Callable[..., Any]:
    def destroy(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            release_pool(self)

    destroy.hostpool_wrapped = True  # type: ignore[attr-defined]
    destroy.__wrapped__ = original  # type: ignore[attr-defined]
    destroy.__name__ = getattr(original, "__name__", "destroy")
    destroy.__doc__ = getattr(original, "__doc__", None)
    return destroy


def release_pool(pool: Any) -> None:
    """Release a host pool's regions explicitly: its normal teardown, not a leak."""
    allocator = getattr(pool, "__dict__", {}).get("allocator")
    if allocator is None:
        return
    close = getattr(allocator, "close", None)
    owner = getattr(allocator, "hostpool_foreign_owner", None)
    if owner is not None:
        owner.close()
    elif close is not None and getattr(allocator, "hostpool_kind", None) is not None:
        close()


# -- metrics where sglang serves them ---------------------------------------------------
def _started() -> None:
    """After each tracked allocation: this process's multiprocess publisher, when sglang
    runs prometheus_client in multiprocess mode (started once per process, forked children
    included). Never raises: publishing must not fail an allocation that succeeded."""
    from hostpool.multiprocess import ensure_publisher

    ensure_publisher()
