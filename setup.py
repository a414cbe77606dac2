"""What pyproject.toml cannot say:
- `hostpool-instrument.pth` at the root of site-packages (wheel and editable installs
  alike): it activates `HOSTPOOL_INSTRUMENT` integrations in every Python process, at the
  cost of one environment lookup when the variable is unset;
- the one compiled part, `hostpool/proc/bulkread.c` (the exporter's loops over every maps
  line and fd a scrape reads), built with the machine's C compiler and Python headers.
Everything else is in pyproject.toml. The editable install's hook relies on an internal of
setuptools, kept in `build_support/editable_pth.py` with the versions it was read from."""

from __future__ import annotations

import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# build_support/ sits next to this file; pip runs this file with another directory first
# on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_support.editable_pth import editable_command

PTH = "hostpool-instrument.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, PTH)
        shutil.copyfile(PTH, target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


BULKREAD = Extension(
    "hostpool.proc.bulkread",
    sources=["hostpool/proc/bulkread.c"],
    extra_compile_args=["-O2", "-Wall", "-Wextra"],  # `make lint` adds -Werror
)

commands: dict[str, type] = {"build_py": BuildWithPth}
editable = editable_command(PTH)  # setuptools' internal, behind its version range
if editable is not None:
    commands["editable_wheel"] = editable

setup(
    cmdclass=commands,
    ext_modules=[BULKREAD],
)
