"""The one internal of CPython's import system hostpool relies on, here once, read from
CPython 3.11 and checked on 3.12 and 3.13; `tests/test_importspec.py` pins it.

`importlib._bootstrap._load_unlocked` sets `spec._initializing = True` before it executes
a module and `False` in a `finally` after, with the module in `sys.modules` under
`spec.name` (its `__spec__` the very spec) when the code ran without raising, and taken
out when it raised. `ModuleSpec` is a plain Python class, so a finder may hand out a spec
whose class is a subclass that watches that flag (`watch`): that is how the post-import
hook (`importhook`) learns that a module has executed, with no frame of its own around
the module's code and the module's real loader untouched.

Outside `GATE` (another interpreter, or a CPython release this was not read from) specs
are left as they are, after one `hostpool.untested_version` warning: an integration then
patches only the modules imported before its `install()`.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from hostpool.base.versiongate import VersionGate

RELIES_ON = "importlib._bootstrap setting ModuleSpec._initializing around a module's code"
FALLBACK = "modules imported after an integration's install() are not patched"
GATE = VersionGate("CPython", (3, 11), (3, 14), relies_on=RELIES_ON, fallback=FALLBACK)

_AFTER = "_hostpool_after"
_FLAG = "_hostpool_initializing"


def interpreter_version() -> str | None:
    """This interpreter's version if it is CPython (None for any other)."""
    if sys.implementation.name != "cpython":
        return None
    return ".".join(map(str, sys.version_info[:3]))


def watch(
    spec: importlib.machinery.ModuleSpec, callbacks: Sequence[Callable[[types.ModuleType], None]]
) -> bool:
    """Make `spec` call each of `callbacks` with its module once the module's code has run
    without raising; False (spec untouched) for a finder's own spec class or outside
    `GATE`."""
    if type(spec) is not importlib.machinery.ModuleSpec or not GATE.check(interpreter_version()):
        return False
    spec.__class__ = _WatchedSpec
    spec.__dict__[_AFTER] = tuple(callbacks)
    return True


class _WatchedSpec(importlib.machinery.ModuleSpec):
    """A ModuleSpec (same attributes, same loader) that calls its callbacks when the
    import system marks the module initialised after its code ran without raising (on
    failure the import system has already taken the module out of `sys.modules`)."""

    @property
    def _initializing(self) -> bool:
        return bool(self.__dict__.get(_FLAG, False))

    @_initializing.setter
    def _initializing(self, value: bool) -> None:
        state = self.__dict__
        was = state.get(_FLAG, False)
        state[_FLAG] = value
        if not (was and not value):
            return
        module: Any = sys.modules.get(self.name)
        if isinstance(module, types.ModuleType) and module.__spec__ is self:
            for after in state.get(_AFTER, ()):
                after(module)
