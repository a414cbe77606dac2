"""CPython's import system as `hostpool.integrations.importspec` relies on it (the one
place that pins it): `_initializing` is set around a module's code by the import system,
so a watched spec learns that the module ran, once, and never when its code raised."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from hostpool.base.versiongate import UNTESTED_VERSION
from hostpool.integrations import importspec


def test_this_interpreter_is_one_it_was_read_from() -> None:
    assert importspec.GATE.allows(importspec.interpreter_version()), sys.version


class _Recording(importlib.machinery.ModuleSpec):
    """Records every value the import system gives `_initializing`."""

    @property
    def _initializing(self) -> bool:
        flags = self.__dict__.get("flags", [])
        return bool(flags and flags[-1][0])

    @_initializing.setter
    def _initializing(self, value: bool) -> None:
        module = sys.modules.get(self.name)
        ran = getattr(module, "RAN", False)
        self.__dict__.setdefault("flags", []).append((value, ran))


@pytest.fixture
def finder(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Modules `hp_probe_*` from `tmp_path`, their specs made by `make(spec)`."""
    state: dict[str, Any] = {"make": lambda spec: None, "specs": {}}

    class Finder:
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if not name.startswith("hp_probe_"):
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, [str(tmp_path)])
            assert spec is not None and type(spec) is importlib.machinery.ModuleSpec
            state["make"](spec)
            state["specs"][name] = spec
            return spec

    (tmp_path / "hp_probe_ok.py").write_text("RAN = True\n")
    (tmp_path / "hp_probe_bad.py").write_text("RAN = True\nraise RuntimeError('boom')\n")
    hook = Finder()
    sys.meta_path.insert(0, hook)
    try:
        yield state
    finally:
        sys.meta_path.remove(hook)
        for name in ("hp_probe_ok", "hp_probe_bad"):
            sys.modules.pop(name, None)


def test_the_import_system_sets_initializing_around_the_modules_code(
    finder: dict[str, Any],
) -> None:
    def record(spec: importlib.machinery.ModuleSpec) -> None:
        spec.__class__ = _Recording

    finder["make"] = record
    importlib.import_module("hp_probe_ok")
    with pytest.raises(RuntimeError):
        importlib.import_module("hp_probe_bad")
    # True before the code ran, False after it (in a finally: also when it raised).
    assert finder["specs"]["hp_probe_ok"].flags == [(True, False), (False, True)]
    assert finder["specs"]["hp_probe_bad"].flags[0] == (True, False)
    assert finder["specs"]["hp_probe_bad"].flags[-1][0] is False
    assert "hp_probe_bad" not in sys.modules  # taken out before the flag was cleared
    assert sys.modules["hp_probe_ok"].__spec__ is finder["specs"]["hp_probe_ok"]


def test_a_watched_spec_calls_back_once_after_success_only(finder: dict[str, Any]) -> None:
    seen: list[tuple[str, bool]] = []

    def after(module: types.ModuleType) -> None:
        seen.append((module.__name__, getattr(module, "RAN", False)))

    finder["make"] = lambda spec: importspec.watch(spec, [after])
    module = importlib.import_module("hp_probe_ok")
    with pytest.raises(RuntimeError):
        importlib.import_module("hp_probe_bad")
    assert seen == [("hp_probe_ok", True)]
    assert module.__spec__.loader is not None
    assert type(module.__loader__).__name__ == "SourceFileLoader"  # the real loader stays


def test_outside_its_versions_specs_are_left_alone(
    finder: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importspec, "interpreter_version", lambda: "3.99.0")
    seen: list[str] = []
    finder["make"] = lambda spec: importspec.watch(spec, [lambda m: seen.append(m.__name__)])
    with structlog.testing.capture_logs() as logs:
        module = importlib.import_module("hp_probe_ok")
    assert seen == [] and type(module.__spec__) is importlib.machinery.ModuleSpec
    (warned,) = [e for e in logs if e["event"] == UNTESTED_VERSION]
    assert warned["package"] == "CPython" and warned["installed"] == "3.99.0"
