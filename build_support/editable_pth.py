"""The one internal of setuptools hostpool's `setup.py` relies on, here once: read from
setuptools 84.2.1 and checked against 68.0.0's source (pyproject's lowest build
requirement); `tests/test_build_support.py` pins it with a real editable build.

PEP 660 editable installs (`pip install -e .`) are built by setuptools' `editable_wheel`
command, which has no hook for adding a file at the root of the wheel. Its `run()` asks
`self._select_strategy(name, tag, build_lib)` for a strategy and uses it as
`with strategy, WheelFile(...) as wheel: strategy(wheel, files, mapping)`. `editable_command`
wraps that strategy so the wheel also carries the `.pth` hook, as the regular wheel does
(`build_py` copies it there).

Outside `MINIMUM` <= setuptools < `BELOW` the editable install is setuptools' own, without
the hook, and the build says so on stderr: `hostpool run` then refuses the interpreter
(it checks for the hook) until the package is installed from a wheel or with a setuptools
in range. Not part of the `hostpool` package: setup.py runs before it exists.
"""

from __future__ import annotations

import re
import sys
from typing import Any

MINIMUM = (68,)
BELOW = (85,)


def in_range(version: str) -> bool:
    """Whether setuptools `version` is one this module was read from (release numbers)."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", version)
    release = tuple(int(p) for p in match.group(1).split(".")) if match else ()
    return bool(release) and MINIMUM <= release < BELOW


class _StrategyWithPth:
    """An editable-wheel strategy that also writes the hook `pth` (a path in the source
    tree) at the root of the wheel."""

    def __init__(self, inner: Any, pth: str) -> None:
        self._inner = inner
        self._pth = pth

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self._inner(wheel, files, mapping)
        with open(self._pth, "rb") as f:
            wheel.writestr(self._pth, f.read())

    def __enter__(self) -> _StrategyWithPth:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


def editable_command(pth: str) -> type | None:
    """setuptools' `editable_wheel` command that also writes `pth`; None (setuptools' own
    command stays) with one line on stderr when setuptools is outside the range."""
    import setuptools
    from setuptools.command.editable_wheel import editable_wheel

    if not in_range(setuptools.__version__):
        lo, hi = ".".join(map(str, MINIMUM)), ".".join(map(str, BELOW))
        print(
            f"hostpool: setuptools {setuptools.__version__} is outside >={lo},<{hi}: this "
            f"editable install lacks {pth} (install from a wheel to get it)",
            file=sys.stderr,
        )
        return None

    class EditableWithPth(editable_wheel):  # type: ignore[misc]
        def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs), pth)

    return EditableWithPth
