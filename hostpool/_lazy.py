"""Lazy imports: package attributes (PEP 562), so `import hostpool` pays for torch only
when a name that needs it is first used; and torch itself, which hostpool never installs
(the engine's environment brings its build), imported where a tensor is handed out."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hostpool.errors import TorchUnavailableError


def lazy_exports(
    package: str, exports: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for a package whose names live in `exports` modules."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace.get("__all__", ())) | set(exports))

    return getattr_, dir_


def require_torch(what: str) -> ModuleType:
    """torch, for `what` (the API that hands out tensors, named in the message).

    Raises TorchUnavailableError, one line saying what to install, where torch cannot be
    imported: hostpool's own requirements never name torch (an engine pins its build)."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise TorchUnavailableError(
            f"{what} needs torch: pip install torch (the engine's build; hostpool does not "
            f"install it, and its operator commands run without it): {exc}"
        ) from exc
