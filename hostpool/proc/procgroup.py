"""A process's shm, grouped: fds and mappings into objects (by inode), objects into
pools, and the findings /proc alone can decide. One process in detail (`read_process`,
`hostpool inspect`) is read by the exporter's reader (`scan.read_holdings` with its
`detail`): the same C parsing of maps and smaps, the same objects; `inspect`, the
exporter and the leak check use these."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from hostpool.proc import bulkread
from hostpool.proc.hostread import key_identity
from hostpool.proc.names import KNOWN_PREFIXES, Kind, ShmName
from hostpool.proc.owners import Ignored, Owners, Reason, ignored_counts
from hostpool.proc.procfs import (
    Pid,
    ProcessAccessError,
    ProcessNotFoundError,
    ProcessShm,
    ShmFd,
    ShmMapping,
    Usage,
)
from hostpool.proc.scan import (
    ROW_ALLOCATED,
    ROW_MATCH,
    ROW_PATH,
    ROW_VMAS,
    VMAS,
    Holdings,
    Key,
    Matcher,
    Row,
    fill_residency,
    mapped_rows,
    read_holdings,
)


@dataclass(frozen=True, slots=True)
class ShmObject:
    """One memfd / shm file / named anonymous region as one process holds it."""

    kind: Kind
    name: ShmName
    dev: int
    ino: int
    fds: tuple[ShmFd, ...]
    mappings: tuple[tuple[ShmMapping, ...], ...]  # logical mappings, each one or more VMAs

    @property
    def size(self) -> int:
        """The object's length: from an fd when held, else what is mapped."""
        return self.fds[0].size if self.fds else self.mapped_bytes

    @property
    def mapped_bytes(self) -> int:
        return sum(vma.size for m in self.mappings for vma in m)

    @property
    def resident_bytes(self) -> int:
        """Bytes behind the VMAs now (smaps Rss + hugetlb), 0 if read without usage."""
        return sum(vma.usage.resident_bytes for m in self.mappings for vma in m if vma.usage)

    @property
    def page_sizes(self) -> frozenset[int]:
        return frozenset(
            vma.usage.kernel_page_size for m in self.mappings for vma in m if vma.usage
        )


def group_objects(process: ProcessShm) -> list[ShmObject]:
    """Fds and VMAs joined by (dev, ino); inode-less anonymous VMAs by name. By name."""
    fds: dict[object, list[ShmFd]] = {}
    vmas: dict[object, list[ShmMapping]] = {}
    first: dict[object, ShmFd | ShmMapping] = {}
    for f in process.fds:
        fds.setdefault((f.dev, f.ino), []).append(f)
        first.setdefault((f.dev, f.ino), f)
    for m in process.mappings:
        key = (m.dev, m.ino) if m.ino else m.name.name
        vmas.setdefault(key, []).append(m)
        first.setdefault(key, m)
    objects = [
        ShmObject(
            kind=item.kind,
            name=item.name,
            dev=item.dev,
            ino=item.ino,
            fds=tuple(fds.get(key, ())),
            mappings=tuple(_logical_mappings(vmas.get(key, []))),
        )
        for key, item in first.items()
    ]
    objects.sort(key=lambda o: (o.name.prefix, o.name.pool, o.name.name))
    return objects


def _logical_mappings(vmas: Iterable[ShmMapping]) -> Iterator[tuple[ShmMapping, ...]]:
    """The VMAs one mmap() was split into (madvise, mprotect) as one mapping, as
    bulkread joined them (`ShmMapping.mapping`); by address."""
    runs: dict[int, list[ShmMapping]] = {}
    for vma in sorted(vmas, key=lambda v: v.start):
        runs.setdefault(vma.mapping, []).append(vma)
    for run in runs.values():
        yield tuple(run)


# -- one process in detail (inspect, the leak check) ------------------------------------


def read_process(
    pid: Pid, prefixes: Sequence[str] = KNOWN_PREFIXES, *, usage: bool = True
) -> ProcessShm:
    """The matched fds and VMAs of `pid`, by fd and by address, through the exporter's
    reader (smaps, a page-table walk, only if some object matched and `usage`). Raises
    ProcessNotFoundError / ProcessAccessError."""
    matcher = Matcher(prefixes)
    read = read_holdings(pid, matcher, detail="smaps" if usage else "maps")
    fds: list[ShmFd] = []
    for key, row in read.rows.items():
        target = row[ROW_PATH].decode(errors="surrogateescape")  # as maps spells it
        fds.extend(_fds(read, key, target, row[ROW_MATCH][0], row[ROW_MATCH][1]))
    for key, (link, name, _count) in read.unmapped_fds.items():
        match = matcher.lookup(link)
        kind: Kind = match[0] if match is not None else "file"
        fds.extend(_fds(read, key, link.decode(errors="surrogateescape"), kind, name))
    fds.sort(key=lambda f: f.fd)
    return ProcessShm(read.pid, tuple(fds), tuple(_vmas(read.rows)))


def shm_mappings(
    pid: Pid, prefixes: Sequence[str] = KNOWN_PREFIXES, *, usage: bool = False
) -> list[ShmMapping]:
    """The matched VMAs of `pid`, by address (with smaps' usage when `usage`)."""
    return list(read_process(pid, prefixes, usage=usage).mappings)


def parse_maps(data: bytes, prefixes: Sequence[str] = KNOWN_PREFIXES) -> list[ShmMapping]:
    """The VMAs of matched objects in maps text (lines split at `\\n` only), by address."""
    return _vmas(mapped_rows(data, Matcher(prefixes), VMAS))


def _identity(key: Key) -> tuple[int, int]:
    """(st_dev, st_ino) of a row's key; (0, 0) for an inode-less object (a path)."""
    return key_identity(key) or (0, 0)


def _fds(read: Holdings, key: Key, target: str, kind: Kind, name: ShmName) -> Iterator[ShmFd]:
    dev, ino = _identity(key)
    for entry, size, allocated in read.held.get(key, ()):
        yield ShmFd(int(entry), target, kind, name, dev, ino, size, allocated)


def _vmas(rows: dict[Key, Row]) -> list[ShmMapping]:
    out = []
    for key, row in rows.items():
        dev, ino = _identity(key)
        kind, name, _pool = row[ROW_MATCH]
        for i, mapping in enumerate(row[ROW_VMAS]):
            for start, end, offset, perms, usage in mapping:
                used = Usage(*usage) if usage is not None else None
                out.append(ShmMapping(start, end, perms, offset, dev, ino, kind, name, used, i))
    return sorted(out, key=lambda m: m.start)


# -- per-pool totals and what /proc alone can flag --------------------------------------


@dataclass(frozen=True, slots=True)
class PoolUsage:
    prefix: str
    pool: str
    objects: int
    open_fds: int
    mappings: int  # logical mappings
    mapped_bytes: int
    resident_bytes: int
    page_sizes: tuple[int, ...]


def pool_usage(objects: Iterable[ShmObject]) -> list[PoolUsage]:
    """Totals per (prefix, pool), sorted."""
    acc: dict[tuple[str, str], list[ShmObject]] = {}
    for obj in objects:
        acc.setdefault((obj.name.prefix, obj.name.pool), []).append(obj)
    return [
        PoolUsage(
            prefix=prefix,
            pool=pool,
            objects=len(objs),
            open_fds=sum(len(o.fds) for o in objs),
            mappings=sum(len(o.mappings) for o in objs),
            mapped_bytes=sum(o.mapped_bytes for o in objs),
            resident_bytes=sum(o.resident_bytes for o in objs),
            page_sizes=tuple(sorted({size for o in objs for size in o.page_sizes})),
        )
        for (prefix, pool), objs in sorted(acc.items())
    ]


FindingKind = Literal["fd_without_mapping", "mapping_without_fd", "mapped_twice"]


@dataclass(frozen=True, slots=True)
class Finding:
    kind: FindingKind
    prefix: str
    pool: str
    name: str
    fds: tuple[int, ...]
    addresses: tuple[str, ...]
    detail: str


def findings(objects: Iterable[ShmObject]) -> list[Finding]:
    """What /proc alone can decide is suspicious, per object.

    - fd_without_mapping: a memfd/shm file held open but mapped nowhere in the process
      (legitimate for a sharing server's spare fd; a leak otherwise).
    - mapping_without_fd: a memfd/shm file mapped but no fd of this process holds it
      (someone closed it, or it was received from a peer and the fd dropped).
    - mapped_twice: two separate mappings of the same object in one process.
    Named anonymous regions have no fd: only mapped_twice applies to them.
    """
    out: list[Finding] = []
    for o in objects:
        flagged: list[tuple[FindingKind, str]] = []
        addresses = tuple(f"{m[0].start:x}-{m[-1].end:x}" for m in o.mappings)
        if o.kind != "anon" and o.fds and not o.mappings:
            flagged.append(("fd_without_mapping", f"{len(o.fds)} fd(s) open, object not mapped"))
        if o.kind != "anon" and o.mappings and not o.fds:
            flagged.append(("mapping_without_fd", f"mapped at {', '.join(addresses)}, no fd"))
        if len(o.mappings) > 1:
            flagged.append(("mapped_twice", f"{len(o.mappings)} separate mappings of one object"))
        fds = tuple(f.fd for f in o.fds)
        n = o.name
        out.extend(Finding(k, n.prefix, n.pool, n.name, fds, addresses, d) for k, d in flagged)
    return out


# -- many processes ---------------------------------------------------------------------

T = TypeVar("T")


@dataclass
class Scan:
    """Every readable process holding a matching fd or mapping."""

    processes: list[ProcessShm] = field(default_factory=list)
    unreadable: int = 0  # processes whose /proc entries this user may not read


def _each_process(
    read: Callable[[int], T], unreadable: list[int], *, stop: Callable[[], bool] | None = None
) -> Iterator[T]:
    """`read(pid)` of every process but this one, in pid order, until `stop()` (asked
    before each): processes gone meanwhile are skipped, those this user may not read are
    appended to `unreadable`."""
    import psutil  # lazy: only the exporter and inspect pay for it

    me = os.getpid()
    for pid in psutil.pids():
        if pid == me:
            continue
        if stop is not None and stop():
            return
        try:
            value = read(pid)
        except ProcessNotFoundError:
            continue
        except ProcessAccessError:
            unreadable.append(pid)
            continue
        yield value


def scan(prefixes: Sequence[str], *, usage: bool = True) -> Scan:
    result, unreadable = Scan(), list[int]()
    for process in _each_process(lambda pid: read_process(pid, prefixes, usage=usage), unreadable):
        if process.fds or process.mappings:
            result.processes.append(process)
    result.unreadable = len(unreadable)
    return result


# -- per-pool totals at scale (the exporter) ----------------------------------------------


@dataclass(slots=True)
class PoolTotals:
    """What processes hold of one (prefix, pool): a sum, so it can add more."""

    open_fds: int = 0
    mappings: int = 0  # logical mappings
    mapped_bytes: int = 0
    resident_bytes: int = 0

    def add(self, other: PoolTotals) -> None:
        self.open_fds += other.open_fds
        self.mappings += other.mappings
        self.mapped_bytes += other.mapped_bytes
        self.resident_bytes += other.resident_bytes


def holdings_totals(holdings: Holdings) -> dict[tuple[str, str], PoolTotals]:
    """One process's holdings summed per (prefix, pool)."""
    out = {pool: PoolTotals(*sums) for pool, sums in bulkread.pool_totals(holdings.rows).items()}
    for _link, name, count in holdings.unmapped_fds.values():
        pool = (name.prefix, name.pool)
        totals = out.get(pool)
        if totals is None:
            totals = out[pool] = PoolTotals()
        totals.open_fds += count
    return out


def measured_pages(read: Iterable[Holdings]) -> dict[Key, int]:
    """Each object's pages, as an fd in some process measured them."""
    return {
        key: row[ROW_ALLOCATED]
        for holdings in read
        for key, row in holdings.rows.items()
        if row[ROW_ALLOCATED] is not None
    }


UNREADABLE_PIDS_KEPT = 10  # pids a scan names of those it could not read


@dataclass
class TotalsScan:
    """Per-pool totals of every readable process holding a match, read within a deadline."""

    processes: list[tuple[int, dict[tuple[str, str], PoolTotals]]] = field(default_factory=list)
    unreadable: int = 0  # processes whose /proc entries this user may not read
    truncated: bool = False  # the deadline passed before every process was read in full
    unreadable_pids: list[int] = field(default_factory=list)  # the first few of them
    # objects left out of every pool (`hostpool.proc.owners`), per (prefix, reason)
    ignored: dict[tuple[str, Reason], int] = field(default_factory=dict)


def scan_totals(matcher: Matcher, *, deadline: float | None = None) -> TotalsScan:
    """`read_holdings` of every process but this one, in pid order, until `deadline`
    (time.monotonic()): what was read by then is returned, with `truncated` set. Objects
    count in their pools by holder (`hostpool.proc.owners`), the others are `ignored`.
    Objects a process maps without an fd for them get their pages once every process was
    read (`fill_residency`): those another process's fd measured, whichever was first."""
    result, unreadable = TotalsScan(), list[int]()
    read: list[Holdings] = []
    read_pids: set[int] = set()

    def past_deadline() -> bool:
        result.truncated = deadline is not None and time.monotonic() > deadline
        return result.truncated

    def holdings_of(pid: int) -> Holdings:
        holdings = read_holdings(pid, matcher, deadline=deadline)
        if holdings.complete:
            read_pids.add(pid)
        return holdings

    for holdings in _each_process(holdings_of, unreadable, stop=past_deadline):
        if holdings.rows or holdings.unmapped_fds:
            read.append(holdings)
        if not holdings.complete:
            result.truncated = True
            break
    result.unreadable, result.unreadable_pids = len(unreadable), unreadable[:UNREADABLE_PIDS_KEPT]
    owners = Owners(matcher, read, read_pids=read_pids, unreadable=unreadable, deadline=deadline)
    ignored: Ignored = {}
    for holdings in read:
        owners.attribute(holdings, ignored)
    result.ignored = ignored_counts(ignored)
    matcher.next_scan([*read, *owners.extra], complete=not result.truncated, more=owners.paths)
    read = [holdings for holdings in read if holdings.rows or holdings.unmapped_fds]
    pages = measured_pages(read) if any(bulkread.unmeasured(h.rows) for h in read) else {}
    for holdings in read:
        # past the budget, no smaps reads: what the scan measured, marked partial
        in_time = deadline is None or time.monotonic() <= deadline
        if not fill_residency(holdings, matcher, pages, smaps=in_time):
            result.truncated = True
        result.processes.append((holdings.pid, holdings_totals(holdings)))
    return result
