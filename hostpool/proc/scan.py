"""What processes hold of the matched shared-memory objects, read from /proc at scale
(the exporter): per object its name, the bytes mapped and the pages it holds."""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from hostpool.errors import ConfigError
from hostpool.proc.names import Kind, ShmName, classify_path, parse_name
from hostpool.proc.procfs import (
    GONE,
    Pid,
    ProcessAccessError,
    ProcessNotFoundError,
    contains,
    open_fd_dir,
    read_proc_bytes,
)
from hostpool.proc.statx import FdStat, Identity

#
# `read_process` keeps every fd and VMA and reads smaps (a page-table walk). The
# exporter needs less per object: its name, the bytes mapped and the pages it holds. So
# maps is parsed in bulk (one regex over the file, one tuple of fields per line, each
# path looked up in the names already parsed), each fd is identified with one syscall
# where possible, and residency is one statx per object (`st_blocks`: the same cost at
# any size).

Key = Identity | bytes  # (st_ino, dev major, dev minor); an inode-less anonymous VMA's path

_CHECK_EVERY: Final = 256  # fds between two looks at the deadline
_NAMES_KEPT: Final = 1 << 20
_ROTATE_EVERY: Final = 16  # complete scans between two clean-ups of the parsed paths
_UNKNOWN: Final[Any] = object()
# a maps (or smaps header) line with a path: start, end, offset, major:minor, inode, path
_MAPS_LINE: Final = rb"^([0-9a-f]+)-([0-9a-f]+) [^ \n]+ ([0-9a-f]+) ([0-9a-f]+:[0-9a-f]+) (\d+) +"


class Matcher:
    """What each path met in maps or an fd link says: the kind and parsed name of a shm
    object that names one of `prefixes`, or None.

    Parsed paths (those that name no match too: a library, `[heap]`) are kept from one
    scan to the next (`next_scan`): a name lives as long as its object, so a scrape
    parses only the paths that are new since the last, and a maps line costs one dict
    lookup. Only the paths the last two scans met are kept, so memory follows what
    processes hold. Not locked: concurrent scans with one Matcher at worst parse a path
    twice.
    """

    def __init__(self, prefixes: Sequence[str]) -> None:
        if not prefixes or not all(prefixes):
            raise ConfigError("a Matcher needs non-empty prefixes")
        self.prefixes = tuple(prefixes)
        self.needles = tuple(p.encode(errors="surrogateescape") for p in self.prefixes)
        # every maps line with a path; smaps headers whose path mentions a prefix (the
        # regex engine skips the other lines and every `Name: value kB` line)
        alternatives = b"|".join(re.escape(n) for n in self.needles)
        self.maps_line = re.compile(_MAPS_LINE + rb"([^\n]+)", re.MULTILINE)
        self.smaps_line = re.compile(
            _MAPS_LINE + rb"([^\n]*?(?:" + alternatives + rb")[^\n]*)$", re.MULTILINE
        )
        self.parsed: dict[bytes, tuple[Kind, ShmName] | None] = {}  # met in this scan
        self._previous: dict[bytes, tuple[Kind, ShmName] | None] = {}
        self.devices: dict[bytes, tuple[int, int]] = {}  # `major:minor` -> ints
        self._scans = 0

    def mentions(self, data: bytes) -> bool:
        """Whether `data` contains any prefix (libc memmem)."""
        return any(contains(data, n) for n in self.needles)

    def lookup(self, path: bytes) -> tuple[Kind, ShmName] | None:
        """(kind, name) for a maps path or an fd's link, None if it names no match."""
        hit = self.parsed.get(path, _UNKNOWN)
        if hit is not _UNKNOWN:
            return hit  # type: ignore[no-any-return]
        hit = self._previous.get(path, _UNKNOWN)
        if hit is _UNKNOWN:
            classified = classify_path(path.decode(errors="surrogateescape"))
            parsed = parse_name(classified[1], self.prefixes) if classified else None
            hit = None if classified is None or parsed is None else (classified[0], parsed)
        self.parsed[path] = hit
        return hit  # type: ignore[no-any-return]

    def device(self, text: bytes) -> tuple[int, int]:
        """(major, minor) of a maps `major:minor` field (few distinct values: cached)."""
        dev = self.devices.get(text)
        if dev is None:
            major, _, minor = text.partition(b":")
            dev = self.devices[text] = (int(major, 16), int(minor, 16))
        return dev

    def key(self, dev: bytes, ino: bytes, path: bytes) -> Key:
        """The object a maps line maps: its identity, or its path when it has no inode."""
        if ino == b"0":
            return path
        major, minor = self.device(dev)
        return int(ino), major, minor

    def next_scan(self, *, complete: bool = True) -> None:
        """Called after each scan: every `_ROTATE_EVERY` complete scans, forget the paths
        none of them met (the objects are gone). Between, and after scans cut short (the
        processes they did not reach still hold theirs), paths are kept, up to a cap on
        what a flood of ever-new names can make it keep."""
        self._scans += complete
        if self._scans >= _ROTATE_EVERY or len(self.parsed) + len(self._previous) > _NAMES_KEPT:
            self._previous, self.parsed, self._scans = self.parsed, {}, 0


@dataclass(slots=True)
class HeldObject:
    """One mapped shm object as one process holds it (summed, no per-VMA detail)."""

    kind: Kind
    name: ShmName
    path: bytes  # as maps shows it: the same text as an fd's link to the object
    mappings: int  # logical mappings (the VMAs one mmap was split into count once)
    mapped_bytes: int
    end: int  # of its last VMA so far, to join the next one
    offset_end: int  # file offset where that VMA ends
    fds: int = 0
    allocated_bytes: int | None = None  # st_blocks * 512 through one of its fds; None: no fd
    smaps_resident: int | None = None  # Rss + hugetlb of its VMAs, read only without an fd

    @property
    def resident_bytes(self) -> int:
        """Pages the object holds (swapped-out shmem pages included), at most the bytes
        mapped here; for an object this process maps without an fd for it, the Rss and
        hugetlb pages of its mappings."""
        if self.allocated_bytes is not None:
            return min(self.allocated_bytes, self.mapped_bytes)
        return self.smaps_resident or 0


@dataclass(frozen=True, slots=True)
class Holdings:
    """What one process holds of the matched objects, for per-pool totals."""

    pid: int
    objects: dict[Key, HeldObject]  # mapped objects, with the fds that refer to them
    unmapped_fds: dict[bytes, tuple[ShmName, int]]  # the other matched fds, by link
    complete: bool  # False when the deadline stopped the reading part way


FdStrategy = Literal["auto", "stat", "link"]


def read_holdings(
    pid: Pid,
    matcher: Matcher,
    *,
    deadline: float | None = None,
    pages: dict[Key, int] | None = None,
    fds_by: FdStrategy = "auto",
) -> Holdings:
    """The matched objects `pid` maps and the matched fds it holds, with each mapped
    object's pages where one of its fds here (or `pages`) tells them.

    Maps first (every mapped object with its inode), then the fd directory, one of two
    ways (`fds_by`; "auto" picks the cheaper, the results are the same): "stat" statx-es
    every fd (one syscall identifies it by inode and gives its object's pages; only
    unmapped regular files are read as links too), the cheaper way when mapped objects
    make up at least a quarter of the fds; "link" reads every fd's link and statx-es one
    fd per mapped object. `pages` (object -> st_blocks * 512) is shared by the reads of
    one scan: it is filled with what this read measured, and saves "link" the statx of
    an object another process measured. Objects left without pages get them from
    `fill_residency`. `deadline` (a time.monotonic() value) stops the reading part way:
    `complete` is then False. Raises ProcessNotFoundError / ProcessAccessError like the
    other readers.
    """
    data = read_proc_bytes(pid, f"/proc/{pid}/maps")
    objects = _mapped_objects(data, matcher) if matcher.mentions(data) else {}
    unmapped, complete = _held_fds(pid, matcher, objects, deadline, fds_by, pages)
    real_pid = os.getpid() if pid == "self" else pid
    return Holdings(real_pid, objects, unmapped, complete)


def fill_residency(
    holdings: Holdings, matcher: Matcher, pages: dict[Key, int], *, smaps: bool = True
) -> bool:
    """Residency for the objects a read left without pages (mapped with no fd in that
    process): the pages another process's fd measured (`pages`), else the Rss and hugetlb
    pages of the process's mappings of it (its smaps; not read when `smaps` is False).
    Called once the whole scan is read, so which process was read first changes nothing.
    A process gone since leaves 0. Returns False if some object was left unmeasured."""
    unresolved: set[Key] = set()
    for key, obj in holdings.objects.items():
        if obj.allocated_bytes is None:
            obj.allocated_bytes = pages.get(key)
            if obj.allocated_bytes is None:
                unresolved.add(key)
    if not unresolved:
        return True
    if not smaps:
        return False
    try:
        measured = _smaps_resident(holdings.pid, matcher, unresolved)
    except (ProcessNotFoundError, ProcessAccessError):
        return True  # gone (or its credentials changed): it is not counted as holding
    for key, resident in measured.items():
        holdings.objects[key].smaps_resident = resident
    return True


def _mapped_objects(data: bytes, matcher: Matcher) -> dict[Key, HeldObject]:
    objects: dict[Key, HeldObject] = {}
    get, known, lookup = objects.get, matcher.parsed.get, matcher.lookup
    devices, device = matcher.devices.get, matcher.device
    for start, end, offset, dev, ino, path in matcher.maps_line.findall(data):
        hit = known(path, _UNKNOWN)
        if hit is _UNKNOWN:
            hit = lookup(path)
        if hit is None:
            continue
        if ino == b"0":
            key: Key = path
        else:
            major, minor = devices(dev) or device(dev)
            key = (int(ino), major, minor)
        lo, hi, at = int(start, 16), int(end, 16), int(offset, 16)
        obj = get(key)
        if obj is None:
            objects[key] = HeldObject(hit[0], hit[1], path, 1, hi - lo, hi, at + hi - lo)
            continue
        # maps is sorted by address: a VMA starting where this object's last one ended,
        # at the next offset in the file, is the rest of one mmap split by madvise
        if not (obj.end == lo and (obj.kind == "anon" or obj.offset_end == at)):
            obj.mappings += 1
        obj.mapped_bytes += hi - lo
        obj.end, obj.offset_end = hi, at + hi - lo
    return objects


Unmapped = dict[bytes, tuple[ShmName, int]]


def _held_fds(
    pid: Pid,
    matcher: Matcher,
    objects: dict[Key, HeldObject],
    deadline: float | None,
    fds_by: FdStrategy,
    pages: dict[Key, int] | None,
) -> tuple[Unmapped, bool]:
    fd_dir, dir_fd = open_fd_dir(pid)
    try:
        try:  # bytes names: links come back as bytes, as maps paths do
            entries = os.listdir(os.fsencode(fd_dir))
        except GONE:
            raise ProcessNotFoundError(pid) from None
        except PermissionError:
            raise ProcessAccessError(pid, fd_dir) from None
        reader = _FdReader(pid, fd_dir, dir_fd, matcher, objects, {} if pages is None else pages)
        with_inode = sum(1 for key in objects if type(key) is tuple)
        if fds_by == "stat" or (fds_by == "auto" and with_inode and 4 * with_inode >= len(entries)):
            return reader.by_stat(entries, deadline)
        return reader.by_link(entries, deadline)
    finally:
        os.close(dir_fd)


class _FdReader:
    """One process's fd directory, read against its mapped objects."""

    def __init__(
        self,
        pid: Pid,
        fd_dir: str,
        dir_fd: int,
        matcher: Matcher,
        objects: dict[Key, HeldObject],
        pages: dict[Key, int],
    ) -> None:
        self.pid, self.fd_dir, self.dir_fd = pid, fd_dir, dir_fd
        self.matcher, self.objects, self.pages = matcher, objects, pages
        self.unmapped: Unmapped = {}

    def by_stat(self, entries: list[bytes], deadline: float | None) -> tuple[Unmapped, bool]:
        get, dir_fd, pages, fdstat = self.objects.get, self.dir_fd, self.pages, FdStat()
        identity, mode_blocks = fdstat.identity, fdstat.mode_blocks
        for first in range(0, len(entries), _CHECK_EVERY):
            if deadline is not None and time.monotonic() > deadline:
                return self.unmapped, False
            for entry in entries[first : first + _CHECK_EVERY]:
                try:
                    key = identity(dir_fd, entry)
                except GONE:
                    continue  # closed since the listing
                except OSError:
                    # its filesystem refused (another user's FUSE mount, a stale NFS
                    # handle): its link still names it; a link we may not read closes
                    # the process to us
                    self._unmapped(entry)
                    continue
                obj = get(key)
                if obj is not None:
                    obj.fds += 1
                    if obj.allocated_bytes is None:  # once per object and process
                        obj.allocated_bytes = pages[key] = mode_blocks()[1] * 512
                elif stat.S_ISREG(mode_blocks()[0]):  # memfds, shm files: regular files
                    self._unmapped(entry)
        return self.unmapped, True

    def by_link(self, entries: list[bytes], deadline: float | None) -> tuple[Unmapped, bool]:
        objects, dir_fd, lookup = self.objects, self.dir_fd, self.matcher.lookup
        needles, fdstat = self.matcher.needles, FdStat()
        by_path: dict[bytes, list[HeldObject]] = {}  # the fd links that name mapped objects
        for key, held in objects.items():
            held.allocated_bytes = self.pages.get(key)  # measured by another process
            if held.kind != "anon":
                by_path.setdefault(held.path, []).append(held)
        for i, entry in enumerate(entries):
            if deadline is not None and i % _CHECK_EVERY == 0 and time.monotonic() > deadline:
                return self.unmapped, False
            target = self._link(entry)
            if target is None or not any(n in target for n in needles):
                continue
            candidates = by_path.get(target)
            if candidates is None:
                hit = lookup(target)
                if hit is not None:
                    self._count(target, hit[1])
                continue
            # which of the objects of that name: its inode says (needed once per object,
            # for its pages); the name alone decides the pool
            if any(held.allocated_bytes is None for held in candidates):
                try:
                    key = fdstat.identity(dir_fd, entry)
                except GONE:
                    continue  # closed since the listing
                except OSError:  # its filesystem refused: the name still decides the pool
                    candidates[0].fds += 1
                    continue
                found = objects.get(key)
                if found is None:
                    self._count(target, candidates[0].name)  # an unmapped namesake
                    continue
                found.allocated_bytes = self.pages[key] = fdstat.mode_blocks()[1] * 512
                found.fds += 1
            else:
                candidates[0].fds += 1  # same name, same pool
        return self.unmapped, True

    def _link(self, entry: bytes) -> bytes | None:
        try:
            return os.readlink(entry, dir_fd=self.dir_fd)
        except GONE:
            return None  # closed since the listing
        except PermissionError:
            raise ProcessAccessError(self.pid, self.fd_dir) from None
        except OSError:
            # a link the kernel cannot spell (ENAMETOOLONG: a file under a path longer
            # than a page, which any user can make): not a name we look for
            return None

    def _unmapped(self, entry: bytes) -> None:
        target = self._link(entry)
        if target is not None and any(n in target for n in self.matcher.needles):
            hit = self.matcher.lookup(target)
            if hit is not None:
                self._count(target, hit[1])

    def _count(self, target: bytes, name: ShmName) -> None:
        seen = self.unmapped.get(target)
        self.unmapped[target] = (name, 1 if seen is None else seen[1] + 1)


def _smaps_resident(pid: Pid, matcher: Matcher, keys: set[Key]) -> dict[Key, int]:
    """Rss + hugetlb pages of the VMAs of `keys` (each smaps entry is its maps line, then
    `Name: value kB` fields, VmFlags last)."""
    data = read_proc_bytes(pid, f"/proc/{pid}/smaps")
    out: dict[Key, int] = {}
    for m in matcher.smaps_line.finditer(data):
        _start, _end, _offset, dev, ino, path = m.groups()
        key = matcher.key(dev, ino, path)
        if key not in keys:
            continue
        stop = data.find(b"\nVmFlags:", m.end())
        stop = len(data) if stop < 0 else stop
        resident = sum(
            _smaps_field(data, field, m.end(), stop)
            for field in (b"\nRss:", b"\nShared_Hugetlb:", b"\nPrivate_Hugetlb:")
        )
        out[key] = out.get(key, 0) + resident
    return out


def _smaps_field(data: bytes, field: bytes, start: int, stop: int) -> int:
    at = data.find(field, start, stop)
    if at < 0:
        return 0
    at += len(field)
    return int(data[at : data.find(b" kB", at, stop)]) * 1024
