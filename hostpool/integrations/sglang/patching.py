"""`install()` / `uninstall()`: sglang's allocator entry points replaced by identity, in
the modules already imported and, through an import hook, in every one imported later
(the package's docstring says what is replaced and why)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from hostpool.base import events
from hostpool.integrations.importhook import Switch, in_package
from hostpool.integrations.sglang import internals
from hostpool.integrations.sglang.labels import (
    current_pool,
    host_pool_class,
    remember_host_pool_class,
)
from hostpool.integrations.sglang.rules import answer_allocator_type, field_of, mmap_options
from hostpool.integrations.sglang.standins import (
    allocator_classes,
    publish_metrics,
    release_pool,
    track_foreign,
)

COMMON, MMAP, BASE = internals.COMMON, internals.MMAP, internals.BASE

# id(original) -> (original, replacement); built when sglang's modules load.
_replacements: dict[int, tuple[Any, Any]] = {}
# (module, attribute, original) and (class, "destroy", original) put back by uninstall().
_patched_attrs: list[tuple[types.ModuleType, str, Any]] = []
_patched_classes: list[tuple[type, str, Any]] = []

is_sglang = in_package("sglang")


def installed() -> bool:
    return _switch.installed


def install() -> None:
    """Patch sglang in this process (now and for modules imported later). Idempotent."""
    with _switch.lock:
        if not _switch.turn_on():
            return
        # The modules that define the originals first, then everything that imported them.
        first = [n for n in (MMAP, COMMON, BASE) if n in sys.modules]
        rest = sorted(n for n in list(sys.modules) if is_sglang(n) and n not in first)
        for name in first + rest:
            module = sys.modules.get(name)
            if isinstance(module, types.ModuleType):
                _after_import(module)


def uninstall() -> None:
    """Restore every patched attribute to sglang's original and remove the import hook."""
    with _switch.lock:
        if not _switch.turn_off():
            return
        originals = {id(rep): orig for orig, rep in _replacements.values()}
        # Modules imported while installed hold replacements too: put originals back by
        # identity everywhere, not only where install() wrote.
        for name in list(sys.modules):
            module = sys.modules.get(name)
            if not (is_sglang(name) and isinstance(module, types.ModuleType)):
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


# -- modules as they load ---------------------------------------------------------------


def _after_import(module: types.ModuleType) -> None:
    if not internals.supported():
        return  # sglang stays as it is (the gate warned once)
    if module.__name__ == MMAP:
        _build_mmap_replacements(module)
    elif module.__name__ == COMMON:
        _build_common_replacements(module)
    elif module.__name__ == BASE and host_pool_class() is None:
        remember_host_pool_class(vars(module).get(internals.HOST_POOL))
    for attr, value in list(vars(module).items()):
        pair = _replacements.get(id(value))
        if pair is not None and pair[0] is value and not _exports(module, attr, value):
            setattr(module, attr, pair[1])
            _patched_attrs.append((module, attr, value))
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


# -- replacements for pool_host/common.py and storage/mmap ------------------------------
def _build_mmap_replacements(module: types.ModuleType) -> None:
    original_shm = vars(module).get(internals.ALLOC_SHM)
    original_mmap = vars(module).get(internals.ALLOC_MMAP)
    if original_shm is not None and id(original_shm) not in _replacements:

        def alloc_shm(dims: tuple[int, ...], dtype: Any) -> tuple[Any, int, Any]:
            """sglang's `alloc_shm` on hostpool: (tensor, fd, mm); the fd is the caller's."""
            from hostpool.integrations.sglang import shapes

            result = shapes.alloc_shm(dims, dtype, pool=current_pool())
            publish_metrics()
            return result

        alloc_shm.__wrapped__ = original_shm  # type: ignore[attr-defined]
        _replace(original_shm, alloc_shm)
    if original_mmap is not None and id(original_mmap) not in _replacements:

        def alloc_mmap(dims: tuple[int, ...], dtype: Any) -> Any:
            """sglang's `alloc_mmap` on hostpool: the tensor owns its mapping."""
            from hostpool.integrations.sglang import shapes

            tensor = shapes.alloc_mmap(dims, dtype, pool=current_pool(), **mmap_options())
            publish_metrics()
            return tensor

        alloc_mmap.__wrapped__ = original_mmap  # type: ignore[attr-defined]
        _replace(original_mmap, alloc_mmap)


def _build_common_replacements(common: types.ModuleType) -> None:
    names = vars(common)
    base = names.get(internals.BASE_ALLOCATOR)
    shm_base = names.get(internals.SHM_ALLOCATOR)
    factory = names.get(internals.DISPATCH)
    type_rule = names.get(internals.TYPE_RULE)
    if base is None or shm_base is None or factory is None or type_rule is None:
        events.warning("hostpool.sglang.unknown_layout", module=COMMON)
        return
    if id(factory) in _replacements:
        return
    default_cls, shm_cls = allocator_classes(base)
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
            track_foreign(allocator, str(allocator_type))
        return allocator

    hip_check = names.get(internals.HIP_CHECK)
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
        source = names[internals.PUBLISHED_CONFIG]() if server_args is None else server_args
        return answer_allocator_type(
            field_of(source, "hicache_storage_backend"),
            field_of(source, "hicache_storage_backend_extra_config"),
        )

    get_allocator_from_storage.__wrapped__ = factory  # type: ignore[attr-defined]
    get_allocator_type.__wrapped__ = type_rule  # type: ignore[attr-defined]
    _replace(factory, get_allocator_from_storage)
    _replace(type_rule, get_allocator_type)


# -- explicit release on destroy() -----------------------------------------------------
def _wrap_destroys(module: types.ModuleType) -> None:
    host_pool = host_pool_class()
    if host_pool is None:
        return
    for value in list(vars(module).values()):
        if not (
            isinstance(value, type)
            and value.__module__ == module.__name__
            and issubclass(value, host_pool)
        ):
            continue
        original = value.__dict__.get(internals.DESTROY)
        if original is None or getattr(original, "hostpool_wrapped", False):
            continue
        setattr(value, internals.DESTROY, _destroying(original))
        _patched_classes.append((value, internals.DESTROY, original))


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


_switch = Switch(is_sglang, _after_import)
