"""The versions of a foreign package whose private internals a hostpool module was read
from, checked once per process.

Each module that reaches into another project's internals (vLLM's, sglang's, CPython's
import system, prometheus_client's values) declares one `VersionGate`: the package, the
release range it was read from and tested against (`minimum` <= release < `below`), what
it relies on, and what hostpool does instead outside that range. `check(version)` is True
inside the range; outside it (or when the version cannot be read) it is False and logs one
`hostpool.untested_version` warning per gate and version, naming all of that: the caller
then takes its safe fallback, never a guess at the other version's internals. A new
upstream release fails that module's pinning test first (tests name it), and production
gets the warning and the fallback instead of a wrong record or a crash.

Versions are compared by their release numbers only (`0.32.0+cpu` and `0.32.1.dev3` are
0.32.x): a range is a span of releases, as the tests pin them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from hostpool.base import events

UNTESTED_VERSION = "hostpool.untested_version"
_RELEASE = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def release_of(version: str | None) -> tuple[int, ...] | None:
    """The release numbers of a version string (`0.32.0+cpu` -> (0, 32, 0)); None when it
    does not start with one."""
    match = _RELEASE.match(version or "")
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


@functools.cache
def distribution_version(name: str) -> str | None:
    """The installed version of distribution `name` (its metadata, not its module: a
    package's `__version__` may not be set yet while its own imports run); None when it
    is not installed."""
    import importlib.metadata  # here: the `.pth` hook's import path stays short

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


@dataclass(frozen=True)
class VersionGate:
    """A foreign package's releases `minimum` <= release < `below` that a module's use of
    its internals (`relies_on`) was read from; `fallback`: what hostpool does outside."""

    package: str
    minimum: tuple[int, ...]
    below: tuple[int, ...]
    relies_on: str
    fallback: str

    @property
    def tested(self) -> str:
        """The range as a version specifier (`>=0.32,<0.33`)."""
        return f">={dotted(self.minimum)},<{dotted(self.below)}"

    def allows(self, version: str | None) -> bool:
        """Whether `version` is in the range (no event)."""
        release = release_of(version)
        return release is not None and self.minimum <= release < self.below

    def check(self, version: str | None) -> bool:
        """`allows(version)`; when not, one `hostpool.untested_version` warning per gate and
        version in this process. Cheap after the first call."""
        return _verdict(self, version)


@functools.cache
def _verdict(gate: VersionGate, version: str | None) -> bool:
    if gate.allows(version):
        return True
    events.warning(
        UNTESTED_VERSION,
        package=gate.package,
        installed=version or "unknown",
        tested=gate.tested,
        relies_on=gate.relies_on,
        fallback=gate.fallback,
    )
    return False
