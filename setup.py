"""What pyproject.toml cannot say:
- `hostpool-instrument.pth` at the root of site-packages (wheel and editable installs
  alike): it activates `HOSTPOOL_INSTRUMENT` integrations in every Python process, at the
  cost of one environment lookup when the variable is unset;
- the one compiled part, `hostpool/proc/bulkread.c` (the exporter's loops over every maps
  line and fd a scrape reads), built with the machine's C compiler and Python headers.
Everything else is in pyproject.toml."""

from __future__ import annotations

import os
import shutil
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "hostpool-instrument.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, PTH)
        shutil.copyfile(PTH, target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class _StrategyWithPth:
    """An editable-wheel strategy that also writes the hook (`pip install -e`)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self._inner(wheel, files, mapping)
        with open(PTH, "rb") as f:
            wheel.writestr(PTH, f.read())

    def __enter__(self) -> _StrategyWithPth:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


class EditableWithPth(editable_wheel):
    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


BULKREAD = Extension(
    "hostpool.proc.bulkread",
    sources=["hostpool/proc/bulkread.c"],
    extra_compile_args=["-O2", "-Wall", "-Wextra"],  # `make lint` adds -Werror
)

setup(
    cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth},
    ext_modules=[BULKREAD],
)
