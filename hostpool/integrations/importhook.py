"""Run a callback on every module of a package right after the module's own code ran,
before any other module can import names from it: how an integration reaches a server's
modules that are imported after `install()` (sglang's scheduler workers import most of
them late).

Invisible by construction: the hook puts nothing between Python and the module's real
loader. The module keeps its real loader before, during and after execution (so
`python -m`, `get_code`, `get_source`, `get_resource_reader`, `is_package`, pkgutil,
inspect and reloads see what they see without the hook), and no frame of hostpool's runs
around the module's code, so a module that fails to import fails with the very same
traceback. The one difference is the class of `module.__spec__`: a `ModuleSpec` subclass
whose `_initializing` flag, which the import system clears once the module has executed,
calls the callback when cleared after success (`importspec`: CPython's internal, with the
versions it was read from).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable, Sequence

from hostpool.integrations import importspec


def in_package(package: str) -> Callable[[str], bool]:
    """A predicate for `package` and its submodules."""
    prefix = package + "."
    return lambda name: name == package or name.startswith(prefix)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Finds matching modules through the other finders on `sys.meta_path` and calls
    `after(module)` once each has executed (not when its code raised). `add()` /
    `remove()` put it first in `sys.meta_path` and take it out again. Several hooks may
    match one module: each callback runs once, in `sys.meta_path` order."""

    def __init__(
        self, matches: Callable[[str], bool], after: Callable[[types.ModuleType], None]
    ) -> None:
        self._matches = matches
        self._after = after

    def add(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not self._matches(fullname):
            return None
        # The first matching hook on sys.meta_path asks the real finders and watches the
        # spec for every hook that matches (the others are not asked: no recursion).
        hooks = [f for f in sys.meta_path if isinstance(f, PostImportHook) and f._matches(fullname)]
        if self not in hooks:
            hooks = [self]
        if hooks[0] is not self:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, PostImportHook) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        importspec.watch(spec, [h._after for h in hooks])  # not a finder's own spec class
        return spec


class Switch:
    """An integration's on/off state: whether it is installed, the import hook that calls
    `on_import(module)` for each module `wanted` names imported while it is on, and the
    re-entrant `lock` that install, uninstall and that callback run under."""

    def __init__(
        self, wanted: Callable[[str], bool], on_import: Callable[[types.ModuleType], None]
    ) -> None:
        self.lock = threading.RLock()
        self.installed = False
        self._wanted = wanted
        self._on_import = on_import
        self._hook: PostImportHook | None = None

    def turn_on(self) -> bool:
        """Mark installed and add the hook (call under `lock`); False if it already was."""
        if self.installed:
            return False
        self.installed = True
        self._hook = PostImportHook(self._wanted, self._late_import)
        self._hook.add()
        return True

    def turn_off(self) -> bool:
        """Mark uninstalled and remove the hook (call under `lock`); False if it was off."""
        if not self.installed:
            return False
        self.installed = False
        if self._hook is not None:
            self._hook.remove()
        self._hook = None
        return True

    def _late_import(self, module: types.ModuleType) -> None:
        with self.lock:
            if self.installed:
                self._on_import(module)
