"""Run a callback on every module of a package right after the module's own code ran,
before any other module can import names from it: how an integration reaches a server's
modules that are imported after `install()` (sglang's scheduler workers import most of
them late). The module keeps its real loader.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any


def in_package(package: str) -> Callable[[str], bool]:
    """A predicate for `package` and its submodules."""
    prefix = package + "."
    return lambda name: name == package or name.startswith(prefix)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Finds matching modules through the other finders on `sys.meta_path` and calls
    `after(module)` once each has executed. `add()` / `remove()` put it first in
    `sys.meta_path` and take it out again."""

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
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            spec.loader = _AfterLoader(loader, self._after)
        return spec


class _AfterLoader(importlib.abc.Loader):
    """The module's real loader with one addition: `after(module)` once `exec_module`
    has run. Everything else Python asks of a loader (`get_code` for `python -m`,
    `get_source`, `get_resource_reader`, `is_package`, `get_filename`, `get_data`, ...)
    is answered by the real loader, and the module and its spec hold the real loader
    once it has executed."""

    def __init__(self, inner: Any, after: Callable[[types.ModuleType], None]) -> None:
        self._inner = inner
        self._after = after

    def __getattr__(self, name: str) -> Any:
        # Only called for names this class does not define: the real loader answers.
        return getattr(self._inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The module keeps its real loader (resources, source lookups, reloads).
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        self._after(module)
