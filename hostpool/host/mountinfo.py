"""One mount namespace's mount table (`/proc/PID/mountinfo`, proc(5)), read as a stream
and folded as it is read: memory bounded by the distinct mounts that matter, whatever
the table holds (a namespace may hold 100,000 bind mounts: fs.mount-max).

`read_table` keeps, per shared-memory superblock (tmpfs, devtmpfs, hugetlbfs, by
`st_dev`): its fstype, its distinct views (`(fs_root, area)`, at most `MAX_VIEWS`), and
the `CANDIDATES` mounts with the shortest root (the whole filesystem before a bind
mount of part of it) as the ways to reach it; and the namespace's mount points: all of
them (what a walk must not enter) and those of types outside `bounds.LOCAL_FSTYPES`
(what no lookup may pass). The file is read in chunks with the budget checked between
them: the kernel itself may take seconds for one large table. Lines split on `\\n` only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

from hostpool.host.bounds import LOCAL_FSTYPES, Budget
from hostpool.host.model import Area

SHM_FSTYPES: Final = frozenset({"tmpfs", "devtmpfs", "hugetlbfs"})
CHUNK: Final = 1 << 16
CANDIDATES: Final = 8  # ways kept to reach a superblock, per namespace
MAX_VIEWS: Final = 256  # distinct (fs_root, area) kept per superblock; more: incomplete
_OCTAL: Final = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class MountEntry:
    """A shared-memory mount line of a mountinfo file."""

    st_dev: int
    fs_root: str
    mountpoint: str
    fstype: str


def unescape(text: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (`\\040`)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), text) if "\\" in text else text


def _decode(raw: bytes) -> str:
    return unescape(raw.decode(errors="surrogateescape"))


def parse_line(line: bytes) -> tuple[str, str, MountEntry | None] | None:
    """(fstype, mount point, the MountEntry if a shared-memory mount) of one line; None
    for a line that is not one."""
    head, sep, tail = line.partition(b" - ")
    if not sep:
        return None
    fields = head.split(b" ", 5)
    if len(fields) < 5:
        return None
    fstype = tail.split(b" ", 1)[0].decode(errors="surrogateescape")
    mountpoint = _decode(fields[4])
    if fstype not in SHM_FSTYPES:
        return fstype, mountpoint, None
    major, _, minor = fields[2].partition(b":")
    try:
        dev = os.makedev(int(major), int(minor))
    except ValueError:
        return None
    return fstype, mountpoint, MountEntry(dev, _decode(fields[3]), mountpoint, fstype)


def parse_mountinfo(data: bytes) -> list[MountEntry]:
    """The tmpfs, devtmpfs and hugetlbfs mounts of a whole mountinfo file."""
    out = []
    for line in data.split(b"\n"):
        parsed = parse_line(line)
        if parsed is not None and parsed[2] is not None:
            out.append(parsed[2])
    return out


def lines(path: str, budget: Budget) -> Iterator[bytes]:
    """The lines of `path`, read in CHUNK-sized reads until the budget is spent (then
    the budget says `mountinfo`). Raises OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        rest = b""
        while not budget.spent("mountinfo"):
            chunk = os.read(fd, CHUNK)
            if not chunk:
                if rest:
                    yield rest
                return
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            yield from parts
    finally:
        os.close(fd)


@dataclass
class Table:
    """What one namespace's mountinfo says that a scan needs (see the module)."""

    candidates: dict[int, list[MountEntry]] = field(default_factory=dict)
    fstypes: dict[int, str] = field(default_factory=dict)
    views: dict[int, set[tuple[str, Area]]] = field(default_factory=dict)
    points: set[str] = field(default_factory=set)  # every mount point
    unsafe: set[str] = field(default_factory=set)  # mount points of non-local types
    complete: bool = True  # False: the budget ran out, or views past MAX_VIEWS


def read_table(path: str, budget: Budget, area: Callable[[str, str], Area]) -> Table:
    """One namespace's table (`area(mountpoint, fstype)`: a view's area). Raises OSError
    when `path` cannot be opened."""
    table = Table()
    for line in lines(path, budget):
        parsed = parse_line(line)
        if parsed is None:
            continue
        fstype, mountpoint, entry = parsed
        table.points.add(mountpoint)
        if fstype not in LOCAL_FSTYPES:
            table.unsafe.add(mountpoint)
        if entry is None:
            continue
        dev = entry.st_dev
        table.fstypes[dev] = fstype
        views = table.views.setdefault(dev, set())
        if len(views) < MAX_VIEWS:
            views.add((entry.fs_root, area(mountpoint, fstype)))
        elif (entry.fs_root, area(mountpoint, fstype)) not in views:
            table.complete = False
        _keep(table.candidates.setdefault(dev, []), entry)
    if budget.truncated:
        table.complete = False
    return table


def _keep(kept: list[MountEntry], entry: MountEntry) -> None:
    """`entry` among the CANDIDATES with the shortest fs_root (the first read on a tie)."""
    if len(kept) >= CANDIDATES and len(entry.fs_root) >= len(kept[-1].fs_root):
        return
    at = len(kept)
    while at and len(kept[at - 1].fs_root) > len(entry.fs_root):
        at -= 1
    kept.insert(at, entry)
    del kept[CANDIDATES:]
