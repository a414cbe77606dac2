"""What processes hold of the matched shared-memory objects, read from /proc at scale
(the exporter): per object its name, the bytes mapped and the pages it holds."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from hostpool.errors import ConfigError
from hostpool.proc import bulkread
from hostpool.proc.names import Kind, ShmName, classify_path, parse_name
from hostpool.proc.procfs import (
    GONE,
    FdDir,
    Pid,
    ProcessAccessError,
    ProcessNotFoundError,
    contains,
    read_proc_bytes,
    walk,
)

#
# `read_process` keeps every fd and VMA and reads smaps (a page-table walk). The
# exporter needs less per object: its name, the bytes mapped and the pages it holds. So
# the per-line and per-fd loops run in C (`bulkread`): maps comes back as one entry per
# object, each fd is identified by one statx and joined to its object there, and Python
# sees objects and the few fds a link must decide. Residency is one statx per object
# (`st_blocks`: the same cost at any size). Each path is parsed once (`Matcher`).

Identity = tuple[int, int, int]  # (st_ino, major(st_dev), minor(st_dev)), as statx gives
Key = Identity | bytes  # an object's identity; an inode-less anonymous VMA's path
PoolKey = tuple[str, str]  # (prefix, pool)
Match = tuple[Kind, ShmName, PoolKey]  # what a path names
# A row per mapped object, what a read knows of it (filled in by bulkread and here):
# [path, match, mappings, mapped_bytes, fds, allocated_bytes or None, smaps_resident or None]
# and, in a detailed read, one more: its logical mappings, each a list of its VMAs
# (start, end, offset, perms, usage), usage (rss, shared_hugetlb, private_hugetlb,
# kernel_page_size) from smaps, else None
Row = list[Any]
ROW_PATH, ROW_MATCH, ROW_MAPPINGS, ROW_MAPPED, ROW_FDS, ROW_ALLOCATED, ROW_SMAPS = range(7)
ROW_VMAS: Final = -1
# bulkread.maps_objects' `detail` flags: each row's VMAs; the data is smaps (usage)
VMAS, SMAPS = 1, 2
Detail = Literal["maps", "smaps"]
Held = dict[Key, list[tuple[bytes, int, int]]]  # object -> (fd entry, st_size, allocated)

_CHECK_EVERY: Final = 256  # fds between two looks at the deadline when links are read
_STALE_SLACK: Final = 1024  # parsed paths a scan did not meet, kept without a clean-up
_UNKNOWN: Final[Any] = object()


class Matcher:
    """What each path met in maps or an fd link says: the kind, parsed name and pool of a
    shm object that names one of `prefixes`, or None.

    Parsed paths (those that name no match too) are kept from one scan to the next
    (`next_scan`): a name lives as long as its object, so a scrape parses only the paths
    that are new since the last, and a maps line costs one dict lookup. Once the paths a
    scan did not meet outnumber an eighth of those it met (and a slack), only those it met
    are kept: processes that make new memfds with new names before every scrape leave at
    most one scan's worth of stale paths, so memory stays within twice what the objects
    held need. Not locked: concurrent scans with one Matcher at worst parse a path twice.
    """

    def __init__(self, prefixes: Sequence[str]) -> None:
        if not prefixes or not all(prefixes):
            raise ConfigError("a Matcher needs non-empty prefixes")
        self.prefixes = tuple(prefixes)
        self.needles = tuple(p.encode(errors="surrogateescape") for p in self.prefixes)
        self.parsed: dict[bytes, Match | None] = {}
        self._kept = 0  # what `parsed` may hold before the next look at what is stale

    def mentions(self, data: bytes) -> bool:
        """Whether `data` contains any prefix (libc memmem)."""
        return any(contains(data, n) for n in self.needles)

    def lookup(self, path: bytes) -> Match | None:
        """(kind, name, pool) for a maps path or an fd's link, None if it names no match."""
        hit = self.parsed.get(path, _UNKNOWN)
        if hit is not _UNKNOWN:
            return hit  # type: ignore[no-any-return]
        classified = classify_path(path.decode(errors="surrogateescape"))
        parsed = parse_name(classified[1], self.prefixes) if classified else None
        if classified is None or parsed is None:
            hit = None
        else:
            hit = (classified[0], parsed, (parsed.prefix, parsed.pool))
        self.parsed[path] = hit
        return hit  # type: ignore[no-any-return]

    def next_scan(
        self, read: Iterable[Holdings] = (), *, complete: bool = True, more: Iterable[bytes] = ()
    ) -> None:
        """Called after each scan with what it read: when the parsed paths have grown past
        what the last look kept, keep only the matched paths `read` met and the paths in
        `more` (the others' objects are gone). After a scan cut short (the processes it
        did not reach still hold theirs) only when they are more than twice those it met."""
        if len(self.parsed) <= self._kept:
            return  # the common case: no more names than the objects the last look kept
        met = {row[ROW_PATH] for h in read for row in h.rows.values()}
        met.update(link for h in read for link, _name, _fds in h.unmapped_fds.values())
        met.update(more)
        bound = len(met) + max(len(met) // 8, _STALE_SLACK)
        if len(self.parsed) > (bound if complete else 2 * bound):
            parsed = self.parsed
            self.parsed = {path: parsed[path] for path in met if path in parsed}
        self._kept = len(self.parsed) + max(len(self.parsed) // 8, _STALE_SLACK)


@dataclass(frozen=True, slots=True)
class Holdings:
    """What one process holds of the matched objects, for per-pool totals."""

    pid: int
    rows: dict[Key, Row]  # the matched mapped objects, with the fds that refer to them
    # the other matched fds, by object (by link if its filesystem refused a stat): the
    # link, its name and how many fds refer to the object
    unmapped_fds: dict[Key, tuple[bytes, ShmName, int]]
    complete: bool  # False when the deadline stopped the reading part way
    held: Held = field(default_factory=dict)  # a detailed read's fds, by object


FdStrategy = Literal["auto", "stat", "link"]


def read_holdings(
    pid: Pid,
    matcher: Matcher,
    *,
    deadline: float | None = None,
    fds_by: FdStrategy = "auto",
    detail: Detail | None = None,
) -> Holdings:
    """The matched objects `pid` maps and the matched fds it holds, with each mapped
    object's pages where one of its fds here tells them.

    Maps first (every mapped object with its inode), then the fd directory, one of two
    ways (`fds_by`; "auto" picks the cheaper, the results are the same): "stat" statx-es
    every fd (one syscall identifies it by inode and gives its object's pages; only
    unmapped regular files are read as links too), the cheaper way when mapped objects
    make up at least a quarter of the fds; "link" reads every fd's link and statx-es one
    fd per mapped object. Objects left without pages get them from `fill_residency`.
    `deadline` (a time.monotonic() value) stops the reading part way: `complete` is then
    False. Raises ProcessNotFoundError / ProcessAccessError like the other readers.

    `detail` (`hostpool inspect`): "maps" gives each row its VMAs (`ROW_VMAS`) and lists
    every fd by object (`held`; fds are then stat-ed); "smaps" also each VMA's usage,
    from smaps (read only when some object matched).
    """
    held: Held | None = {} if detail else None
    unmapped: Unmapped = {}

    def objects(data: bytes) -> dict[Key, Row]:
        if not matcher.mentions(data):
            return {}
        rows = mapped_rows(data, matcher, VMAS if detail else 0)
        if detail == "smaps" and rows:  # the page-table walk only when something matched
            rows = mapped_rows(read_proc_bytes(pid, f"/proc/{pid}/smaps"), matcher, VMAS | SMAPS)
        return rows

    def fds(rows: dict[Key, Row], fd_dir: FdDir) -> bool:
        reader = _FdReader(fd_dir, matcher, rows, unmapped, held)
        entries = fd_dir.entries
        if held is not None:
            complete = reader.by_stat(deadline)
            reader.name_by_link()
            return complete
        if fds_by == "stat":
            return reader.by_stat(deadline)
        if fds_by == "auto" and rows and 4 * len(rows) >= len(entries):
            return reader.by_stat(deadline)
        return reader.by_link(deadline)

    real_pid, rows, complete = walk(pid, objects, fds)
    return Holdings(real_pid, rows, unmapped, complete, {} if held is None else held)


def fill_residency(
    holdings: Holdings, matcher: Matcher, pages: dict[Key, int], *, smaps: bool = True
) -> bool:
    """Residency for the objects a read left without pages (mapped with no fd in that
    process): the pages another process's fd measured (`pages`), else the Rss and hugetlb
    pages of the process's mappings of it (its smaps; not read when `smaps` is False).
    Called once the whole scan is read, so which process was read first changes nothing.
    A process gone since leaves 0. Returns False if some object was left unmeasured."""
    unresolved: set[Key] = set()
    for key in bulkread.unmeasured(holdings.rows):
        allocated = holdings.rows[key][ROW_ALLOCATED] = pages.get(key)
        if allocated is None:
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
        holdings.rows[key][ROW_SMAPS] = resident
    return True


def mapped_rows(data: bytes, matcher: Matcher, detail: int = 0) -> dict[Key, Row]:
    """The rows of the matched objects that the maps (or smaps) text `data` maps (paths
    met before are looked up in C; only new ones are parsed here); `detail` is
    bulkread.maps_objects' (VMAS, SMAPS)."""
    rows, unnamed = bulkread.maps_objects(data, matcher.needles, matcher.parsed, None, detail)
    for key in unnamed:
        row = rows[key]
        row[ROW_MATCH] = matcher.lookup(row[ROW_PATH])
        if row[ROW_MATCH] is None:
            del rows[key]
    return rows


Unmapped = dict[Key, tuple[bytes, ShmName, int]]


class _FdReader:
    """One process's fd directory, read against the rows of its mapped objects: the
    matched fds that are none of them are counted in `unmapped`; with `held`, every fd
    is listed by its object there too."""

    def __init__(
        self,
        fd_dir: FdDir,
        matcher: Matcher,
        rows: dict[Key, Row],
        unmapped: Unmapped,
        held: Held | None,
    ) -> None:
        self.pid, self.fd_dir, self.dir_fd = fd_dir.pid, fd_dir.path, fd_dir.fd
        self.entries = fd_dir.entries
        self.matcher, self.rows, self.unmapped, self.held = matcher, rows, unmapped, held

    def by_stat(self, deadline: float | None) -> bool:
        entries = self.entries
        unmatched, read = bulkread.stat_fds(
            self.dir_fd, entries, self.rows, deadline, None, self.held
        )
        for entry in unmatched:
            # a regular file that is no mapped object (memfds and shm files are regular
            # files), or an fd its filesystem refused to stat (another user's FUSE mount,
            # a stale NFS handle): its link names it; a link we may not read closes the
            # process to us
            self._unmapped(entry)
        return read == len(entries)

    def by_link(self, deadline: float | None) -> bool:
        entries, rows, dir_fd, lookup = self.entries, self.rows, self.dir_fd, self.matcher.lookup
        needles = self.matcher.needles
        by_path: dict[bytes, list[Row]] = {}  # the fd links that name mapped objects
        for row in rows.values():
            if row[ROW_MATCH][0] != "anon":
                by_path.setdefault(row[ROW_PATH], []).append(row)
        for i, entry in enumerate(entries):
            if deadline is not None and i % _CHECK_EVERY == 0 and time.monotonic() > deadline:
                return False
            target = self._link(entry)
            if target is None or not any(n in target for n in needles):
                continue
            # maps spells a newline in a path `\012`, a link has it as it is
            candidates = by_path.get(target.replace(b"\n", b"\\012") if b"\n" in target else target)
            if candidates is None:
                hit = lookup(target)
                if hit is not None:
                    self._count(entry, target, hit[1])
                continue
            # which of the objects of that name: its inode says (needed once per object,
            # for its pages); the name alone decides the pool
            if any(row[ROW_ALLOCATED] is None for row in candidates):
                try:
                    key, _mode, blocks = bulkread.stat_fd(dir_fd, entry)
                except GONE:
                    continue  # closed since the listing
                except OSError:  # its filesystem refused: the name still decides the pool
                    candidates[0][ROW_FDS] += 1
                    continue
                found = rows.get(key)
                if found is None:  # an unmapped namesake
                    self._count(entry, target, candidates[0][ROW_MATCH][1], key)
                    continue
                found[ROW_ALLOCATED] = blocks * 512
                found[ROW_FDS] += 1
            else:
                candidates[0][ROW_FDS] += 1  # same name, same pool
        return True

    def name_by_link(self) -> None:
        """A detailed read: the objects whose maps path may spell a newline (`\\012`)
        named by an fd's link instead, which has the name as it is (as inspect shows
        names)."""
        assert self.held is not None
        for key, row in self.rows.items():
            fds = self.held.get(key)
            if fds and b"\\012" in row[ROW_PATH]:
                link = self._link(fds[0][0])
                hit = self.matcher.lookup(link) if link is not None else None
                if hit is not None:
                    row[ROW_PATH], row[ROW_MATCH] = link, hit

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
                self._count(entry, target, hit[1])

    def _count(self, entry: bytes, target: bytes, name: ShmName, key: Key | None = None) -> None:
        """A matched fd that is no mapped object, counted by the object it refers to (its
        identity says whose it is: `owners`)."""
        if key is None:
            try:
                key = bulkread.stat_fd(self.dir_fd, entry)[0]
            except GONE:
                return  # closed since the listing
            except OSError:  # its filesystem refused a stat: its link stands for it
                key = target
                if self.held is not None:
                    self.held.setdefault(key, []).append((entry, 0, 0))
        seen = self.unmapped.get(key)
        self.unmapped[key] = (target, name, 1 if seen is None else seen[2] + 1)


def _smaps_resident(pid: Pid, matcher: Matcher, keys: set[Key]) -> dict[Key, int]:
    """Rss + hugetlb pages of the VMAs of `keys`, from smaps (parsed in C, as maps is)."""
    rows = mapped_rows(read_proc_bytes(pid, f"/proc/{pid}/smaps"), matcher, SMAPS)
    return {key: row[ROW_SMAPS] for key, row in rows.items() if key in keys}
