"""Shared-memory leak check: what a block of code left open or mapped, read from /proc/self.

    from hostpool.testing import assert_no_leaks

    with assert_no_leaks():                 # baseline now, check at exit
        run_code_under_test()

    check = assert_no_leaks(prefixes=("hostpool.", "sglang_host_pool_"))
    ...                                     # baseline taken above
    check.verify()                          # raises ShmLeakError naming what leaked
    leaks = check.leaks()                   # or look without raising

The identity compared is (fd, st_dev, st_ino) for shm fds, so a closed fd whose number
the kernel hands to a new memfd still counts as new, and the text of shm lines of
/proc/self/maps (address, offset, inode, name). Objects present at the baseline and
still present are not leaks; objects closed meanwhile are ignored.

A first difference may be garbage that only a collection frees (a tensor in a
reference cycle): only then is `gc.collect()` run (slow with torch loaded) and the
state read again. What remains is reported with its pool, size and, when hostpool's
ledger tracked the allocation (always for a test the pytest plugin checks; elsewhere
`HOSTPOOL_TRACK_STACKS=1`), the stack that allocated it, from the frame below the test
runner's last (pytest's and pluggy's frames are dropped: the test's own remain).

This module never imports torch or hostpool's allocators: the ledger is consulted only
if the program already imported it.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from hostpool.base.units import format_size
from hostpool.errors import InvalidRequestError
from hostpool.proc import names, procfs, procgroup
from hostpool.proc.textsafe import printable

DEFAULT_PREFIXES: tuple[str, ...] = (names.HOSTPOOL_PREFIX,)


@dataclass(frozen=True, slots=True)
class ShmState:
    """The process's shm fds as (fd, dev, ino) and its shm maps lines, at one moment."""

    fds: frozenset[tuple[int, int, int]]
    maps: frozenset[str]

    @classmethod
    def read(cls, prefixes: Sequence[str]) -> ShmState:
        fds = procfs.shm_fds("self", prefixes)
        return cls(
            frozenset((f.fd, f.dev, f.ino) for f in fds),
            frozenset(procfs.shm_maps_lines("self", prefixes)),
        )

    def added_since(self, baseline: ShmState) -> ShmState:
        return ShmState(self.fds - baseline.fds, self.maps - baseline.maps)

    def __bool__(self) -> bool:
        return bool(self.fds or self.maps)


@dataclass(frozen=True, slots=True)
class Leak:
    """One shm object with fds or mappings left behind, as /proc and the ledger know it."""

    kind: names.Kind
    name: str
    prefix: str
    pool: str
    size: int
    fds: tuple[int, ...]
    mappings: tuple[str, ...]  # "start-end" addresses
    in_ledger: bool = False  # hostpool's ledger made it (in this process)
    stack: str | None = None  # where, when stacks are tracked

    def describe(self) -> str:
        # the name is whatever the creator chose: escaped, it cannot forge report lines
        name = printable(self.name)
        parts = [f"pool {self.pool!r}: {self.kind} {name}, {format_size(self.size)}"]
        if self.fds:
            parts.append(f"fd {', '.join(map(str, self.fds))}")
        if self.mappings:
            parts.append(f"mapped at {', '.join(self.mappings)}")
        text = "; ".join(parts)
        if self.stack:
            text += "\n    allocated at:\n" + _indent(self.stack.rstrip(), "      ")
        elif self.in_ledger:
            text += "\n    (set HOSTPOOL_TRACK_STACKS=1 to see where it was allocated)"
        return text


class ShmLeakError(AssertionError):
    """Shared-memory fds or mappings outlived the checked code. `.leaks` lists them."""

    def __init__(self, leaks: Sequence[Leak]) -> None:
        self.leaks = tuple(leaks)
        lines = [f"{len(self.leaks)} shared-memory object(s) leaked:"]
        lines += ["  " + leak.describe() for leak in self.leaks]
        super().__init__("\n".join(lines))


class LeakCheck(AbstractContextManager["LeakCheck"]):
    """A baseline of this process's shm fds and mappings, and the check against it.

    A context manager: the check runs at exit, unless the block raised (its exception
    is the story; objects it left behind would only add noise).
    """

    def __init__(self, prefixes: str | Iterable[str] = DEFAULT_PREFIXES) -> None:
        self.prefixes = as_prefixes(prefixes)
        self.baseline = ShmState.read(self.prefixes)

    def leaks(self) -> list[Leak]:
        """What is open or mapped now that was not at the baseline (after a gc if needed)."""
        added = ShmState.read(self.prefixes).added_since(self.baseline)
        if not added:
            return []
        gc.collect()
        added = ShmState.read(self.prefixes).added_since(self.baseline)
        return describe(added, self.prefixes) if added else []

    def verify(self) -> None:
        leaks = self.leaks()
        if leaks:
            raise ShmLeakError(leaks)

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:  # the block raised nothing: check what it left behind
            self.verify()


def assert_no_leaks(prefixes: str | Iterable[str] = DEFAULT_PREFIXES) -> LeakCheck:
    """Take a baseline now; `verify()` it later or use it as a `with` block.

    `prefixes`: one name prefix (a str) or several; InvalidRequestError for none, an
    empty one, or one that is not a str.
    """
    return LeakCheck(prefixes)


def as_prefixes(prefixes: object) -> tuple[str, ...]:
    """`prefixes` as a tuple of non-empty strs; a str is one prefix, not its characters."""
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    if not isinstance(prefixes, Iterable):
        raise InvalidRequestError(f"leak check prefixes must be a str or strs, got {prefixes!r}")
    out: tuple[object, ...] = tuple(prefixes)
    if not out:
        raise InvalidRequestError("the leak check needs at least one name prefix")
    strs = tuple(p for p in out if isinstance(p, str) and p)
    if len(strs) != len(out):
        raise InvalidRequestError(
            "a leak check prefix must be a non-empty str (an empty one matches every "
            f"memfd), got {out!r}"
        )
    return strs


def describe(added: ShmState, prefixes: Sequence[str]) -> list[Leak]:
    """Group new fds and maps lines by object and attach what the ledger knows."""
    fds = [f for f in procfs.shm_fds("self", prefixes) if (f.fd, f.dev, f.ino) in added.fds]
    # in address order, as maps has them (the C parser, inspect's, joins split VMAs)
    lines = sorted(added.maps, key=lambda line: int(line.partition("-")[0], 16))
    maps = procgroup.parse_maps("\n".join(lines).encode(errors="surrogateescape"), prefixes)
    objects = procgroup.group_objects(procfs.ProcessShm(0, tuple(fds), tuple(maps)))
    known = _ledger_regions()
    return [
        Leak(
            kind=o.kind,
            name=o.name.name,
            prefix=o.name.prefix,
            pool=o.name.pool,
            size=o.size,
            fds=tuple(f.fd for f in o.fds),
            mappings=tuple(f"{m[0].start:x}-{m[-1].end:x}" for m in o.mappings),
            in_ledger=(o.dev, o.ino) in known or o.name.name in known,
            stack=own_frames(known.get((o.dev, o.ino)) or known.get(o.name.name)),
        )
        for o in objects
    ]


# The test runners whose frames sit above a test's own in every stack it allocates from.
RUNNER_MODULES = ("_pytest", "pluggy", "pytest")


def own_frames(stack: str | None) -> str | None:
    """`stack` (traceback.format_list text, outermost first) from the frame after the
    last one in a loaded test runner's package: the test's own frames, its fixtures' and
    helpers'. Unchanged when no runner is loaded or no frame is the runner's."""
    if not stack:
        return stack
    roots = tuple(
        os.path.dirname(path) + os.sep
        for name in RUNNER_MODULES
        if (path := getattr(sys.modules.get(name), "__file__", None))
    )
    frames = _FRAME.split(stack)[1:]  # each: the file name, then the rest of its frame
    files, texts = frames[0::2], frames[1::2]
    last = max((i for i, f in enumerate(files) if roots and f.startswith(roots)), default=-1)
    if last < 0 or last == len(files) - 1:
        return stack
    own = zip(files[last + 1 :], texts[last + 1 :], strict=True)
    return "".join(f'  File "{f}"{t}' for f, t in own)


# A frame's first line in traceback.format_list's text; the file name is captured.
_FRAME = re.compile(r'^  File "(.*?)"(?=, line \d+)', re.MULTILINE)


def _ledger_regions() -> dict[Any, str | None]:
    """Regions the ledger knows, by (dev, ino) and by name, with their allocation stacks
    (None unless tracked), if hostpool's ledger is loaded.

    Written against the ledger's snapshot records (`name`, `device`, `inode`, `stack`),
    defensively: a leak report must never fail because of the ledger.
    """
    lifecycle = sys.modules.get("hostpool.core.ledger")
    if lifecycle is None:
        return {}
    try:
        records = lifecycle.get_ledger().snapshot()
    except Exception:
        return {}
    stacks: dict[Any, str | None] = {}
    for record in records:
        stack = getattr(record, "stack", None) or None
        name = getattr(record, "name", None)
        if name:
            stacks[name] = stack
        device, inode = getattr(record, "device", None), getattr(record, "inode", None)
        if device is not None and inode is not None:
            stacks[(device, inode)] = stack
    return stacks


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())
