"""Shared-memory fds and mappings of any process, read from /proc.

OS layer: parsing only (no policy, metrics or logging configuration). Used by
`hostpool inspect`, `hostpool exporter` and the pytest leak check.

What /proc shows for shared memory:
- fds: `/proc/PID/fd/N` links to `/memfd:NAME (deleted)` (memfd, hugetlb memfds too) or to
  `/dev/shm/NAME [(deleted)]` (the fallback file); `os.stat` through the link gives the
  object's (st_dev, st_ino), the only identity that survives fd-number reuse.
- mappings: lines of /proc/PID/maps with the same paths, the same (dev, ino) in the
  `dev inode` columns, and `[anon:NAME]` / `[anon_shmem:NAME]` for named anonymous VMAs
  (no fd, no inode). /proc/PID/smaps adds Rss, hugetlb pages and the page size per VMA.

Names: `<prefix><pool>.<pid>.<seq>[.<random>]` (hostpool, and hostpool's sglang
compatibility prefix). sglang's own raw names (`sglang_host_pool_<hex>[.mmap]`) carry no
pool: they are grouped under pool `-`.

A process that exits while it is read raises ProcessNotFoundError from any step (ENOENT
or ESRCH); scans skip it. Names are returned as /proc shows them (undecodable bytes as
surrogate escapes): printing them is the presentation's job (`hostpool.textsafe`).
"""

from __future__ import annotations

import ctypes
import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from hostpool.errors import ConfigError, HostPoolError
from hostpool.procaccess import why_denied, why_not_found

HOSTPOOL_PREFIX: Final = "hostpool."
SGLANG_PREFIX: Final = "sglang_host_pool_"
KNOWN_PREFIXES: Final[tuple[str, ...]] = (HOSTPOOL_PREFIX, SGLANG_PREFIX)
NO_POOL: Final = "-"

Pid = int | Literal["self"]
Kind = Literal["memfd", "file", "anon"]

# what /proc raises for a process that has exited (or an fd closed) since it was listed:
# ENOENT once its entries are gone, ESRCH while it is being torn down
_GONE: Final = (FileNotFoundError, ProcessLookupError)
_DELETED: Final = " (deleted)"
_MEMFD: Final = "/memfd:"
_DEVSHM: Final = "/dev/shm/"
_ANON_TAGS: Final = ("[anon:", "[anon_shmem:")
# `<pool>.<pid>.<seq>` and the fallback file's `.<random>`; pools match [A-Za-z0-9_-]{1,64}.
_STRUCTURED = re.compile(r"([A-Za-z0-9_-]{1,64})\.(\d+)\.(\d+)(?:\.[A-Za-z0-9_-]+)?")


class ProcfsError(HostPoolError):
    """/proc could not tell us about a process."""


class ProcessNotFoundError(ProcfsError, LookupError):
    """No such process (or it exited while being read); `hint` says what else can make a
    process look absent (hidepid, a PID namespace), when the caller asked."""

    def __init__(self, pid: Pid, hint: str = "") -> None:
        super().__init__(f"no process with pid {pid}" + (f" visible here: {hint}" if hint else ""))
        self.pid = pid
        self.hint = hint


class ProcessAccessError(ProcfsError, PermissionError):
    """The process exists but this user may not read its fds or mappings.

    The message names what is missing (procaccess.why_denied); it is worked out when
    first shown, not when raised: a scan meets hundreds of these per pass.
    """

    def __init__(self, pid: Pid, path: str) -> None:
        super().__init__(pid, path)
        self.pid = pid
        self.path = path
        self._message: str | None = None

    def __str__(self) -> str:
        if self._message is None:
            pid = os.getpid() if self.pid == "self" else self.pid
            self._message = f"permission denied reading {self.path}: {why_denied(pid)}"
        return self._message


# -- names ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShmName:
    """A shared-memory object's name and what it says about its owner."""

    name: str
    prefix: str  # the (longest) requested prefix it starts with
    pool: str  # NO_POOL when the name carries none
    owner_pid: int | None = None  # the pid in the name: the creator, not necessarily a holder
    seq: int | None = None


def parse_name(name: str, prefixes: Sequence[str] = KNOWN_PREFIXES) -> ShmName | None:
    """The pool and owner encoded in `name`, or None when no prefix matches.

    The pool is read after the known family prefix (`hostpool.`, `sglang_host_pool_`)
    even when a narrower prefix such as `hostpool.kv` selected the name.
    """
    matched = ""
    for prefix in prefixes:
        if name.startswith(prefix) and len(prefix) > len(matched):
            matched = prefix
    if not matched and "" not in prefixes:
        return None
    family = next((f for f in KNOWN_PREFIXES if name.startswith(f)), matched)
    m = _STRUCTURED.fullmatch(name, len(family))
    if m is None:
        return ShmName(name, matched, NO_POOL)
    return ShmName(name, matched, m.group(1), int(m.group(2)), int(m.group(3)))


def classify_path(path: str) -> tuple[Kind, str] | None:
    """(kind, object name) for a /proc fd link target or maps path that may be shm."""
    if path.startswith(_MEMFD):
        return "memfd", path[len(_MEMFD) :].removesuffix(_DELETED)
    if path.startswith(_DEVSHM):
        return "file", path[len(_DEVSHM) :].removesuffix(_DELETED)
    if path.endswith(_DELETED) and path.startswith("/"):
        # a fallback file in another `fallback_dir`: unlinked at once, so always deleted
        return "file", path.removesuffix(_DELETED).rpartition("/")[2]
    for tag in _ANON_TAGS:
        if path.startswith(tag) and path.endswith("]"):
            return "anon", path[len(tag) : -1]
    return None


# -- fds ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShmFd:
    """One fd of a process that refers to a shared-memory object."""

    fd: int
    target: str  # the link text, e.g. "/memfd:hostpool.kv.12.0 (deleted)"
    kind: Kind
    name: ShmName
    dev: int
    ino: int
    size: int  # st_size: the object's length
    allocated_bytes: int  # st_blocks * 512: pages the object holds now (shmem, hugetlbfs)


def shm_fds(pid: Pid, prefixes: Sequence[str] = KNOWN_PREFIXES) -> list[ShmFd]:
    """The process's fds whose shm object name starts with one of `prefixes`, by fd."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except _GONE:
        raise ProcessNotFoundError(pid) from None
    except PermissionError:
        raise ProcessAccessError(pid, fd_dir) from None
    try:
        return _shm_fds_in(dir_fd, pid, fd_dir, prefixes)
    finally:
        os.close(dir_fd)


def _shm_fds_in(dir_fd: int, pid: Pid, fd_dir: str, prefixes: Sequence[str]) -> list[ShmFd]:
    # readlink/stat relative to an open /proc/PID/fd: no path walk per fd (the leak check
    # runs this around every test, over up to thousands of fds)
    out: list[ShmFd] = []
    try:
        entries = os.listdir(dir_fd)
    except _GONE:  # exited between the open and the listing
        raise ProcessNotFoundError(pid) from None
    except PermissionError:
        raise ProcessAccessError(pid, fd_dir) from None
    for entry in entries:
        try:
            target = os.readlink(entry, dir_fd=dir_fd)
        except _GONE:
            continue  # closed since the listing (or our own dir_fd's listing entry)
        except PermissionError:
            raise ProcessAccessError(pid, fd_dir) from None
        except OSError:
            continue  # a link /proc cannot spell (ENAMETOOLONG): not a name we look for
        for prefix in prefixes:  # cheap substring filter before any parsing or stat
            if prefix in target:
                break
        else:
            continue
        classified = classify_path(target)
        parsed = parse_name(classified[1], prefixes) if classified else None
        if classified is None or parsed is None:
            continue
        try:
            st = os.stat(entry, dir_fd=dir_fd)
        except _GONE:
            continue
        out.append(ShmFd(int(entry), target, classified[0], parsed, st.st_dev, st.st_ino,
                         st.st_size, st.st_blocks * 512))  # fmt: skip
    out.sort(key=lambda f: f.fd)
    return out


# -- mappings -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """What smaps adds to a VMA: memory behind it now, and its page size."""

    rss: int
    shared_hugetlb: int
    private_hugetlb: int
    kernel_page_size: int

    @property
    def resident_bytes(self) -> int:
        # hugetlb pages are not in Rss
        return self.rss + self.shared_hugetlb + self.private_hugetlb


@dataclass(frozen=True, slots=True)
class ShmMapping:
    """One VMA (one line of /proc/PID/maps) of a shared-memory object."""

    start: int
    end: int
    perms: str
    offset: int
    dev: int  # 0 for anonymous VMAs
    ino: int  # 0 for anonymous VMAs
    kind: Kind
    name: ShmName
    usage: Usage | None = None  # set when read from smaps

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def address(self) -> str:
        return f"{self.start:x}-{self.end:x}"


def shm_mappings(
    pid: Pid, prefixes: Sequence[str] = KNOWN_PREFIXES, *, usage: bool = False
) -> list[ShmMapping]:
    """VMAs of objects whose name starts with a prefix, by address.

    `usage=True` reads smaps instead of maps: the kernel then walks the page tables of
    every VMA of the process (~70 ms per populated 4 GiB), so ask only when needed.
    """
    path = f"/proc/{pid}/{'smaps' if usage else 'maps'}"
    text = read_proc_text(pid, path)
    if not any(p in text for p in prefixes):
        return []
    if usage:
        return _parse_smaps(text, prefixes)
    out = []
    for line in text.splitlines():
        mapping = parse_maps_line(line, prefixes) if any(p in line for p in prefixes) else None
        if mapping is not None:
            out.append(mapping)
    return out


def shm_maps_lines(pid: Pid, prefixes: Sequence[str] = KNOWN_PREFIXES) -> list[str]:
    """The raw maps lines that mention a prefix: the leak check's cheap identity of VMAs."""
    data = read_proc_bytes(pid, f"/proc/{pid}/maps")  # bytes: no decoding of other lines
    wanted = [p.encode() for p in prefixes]
    if not any(_contains(data, p) for p in wanted):
        return []
    return [
        line.decode(errors="surrogateescape")
        for line in data.splitlines()
        if any(p in line for p in wanted)
    ]


def _contains(haystack: bytes, needle: bytes) -> bool:
    """`needle in haystack`, through libc's memmem where available: ~4x faster on a
    50 KB maps file (bytes.__contains__ skips poorly on paths full of '.')."""
    global _memmem
    if _memmem is None:
        _memmem = _load_memmem()
    if _memmem is False:
        return needle in haystack
    return bool(_memmem(haystack, len(haystack), needle, len(needle)))


def _load_memmem() -> Any:
    try:
        import ctypes

        memmem = ctypes.CDLL(None).memmem
    except (OSError, AttributeError):
        return False
    memmem.restype = ctypes.c_void_p
    memmem.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    return memmem


_memmem: Any = None  # loaded on first use; False where libc has none


def read_proc_bytes(pid: Pid, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except _GONE:
        raise ProcessNotFoundError(pid) from None
    except PermissionError:
        raise ProcessAccessError(pid, path) from None


def read_proc_text(pid: Pid, path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except _GONE:
        raise ProcessNotFoundError(pid) from None
    except PermissionError:
        raise ProcessAccessError(pid, path) from None


def parse_maps_line(line: str, prefixes: Sequence[str] = KNOWN_PREFIXES) -> ShmMapping | None:
    """One line of /proc/PID/maps, if it maps a shm object whose name has a prefix."""
    fields = line.split(None, 5)
    if len(fields) < 6:
        return None
    classified = classify_path(fields[5])
    if classified is None:
        return None
    kind, object_name = classified
    parsed = parse_name(object_name, prefixes)
    if parsed is None:
        return None
    start, _, end = fields[0].partition("-")
    major, _, minor = fields[3].partition(":")
    return ShmMapping(
        start=int(start, 16),
        end=int(end, 16),
        perms=fields[1],
        offset=int(fields[2], 16),
        dev=os.makedev(int(major, 16), int(minor, 16)),
        ino=int(fields[4]),
        kind=kind,
        name=parsed,
    )


_USAGE_KEYS: Final = {
    "Rss:": "rss",
    "Shared_Hugetlb:": "shared_hugetlb",
    "Private_Hugetlb:": "private_hugetlb",
    "KernelPageSize:": "kernel_page_size",
}
_HEADER_START: Final = frozenset("0123456789abcdef")  # field lines start with a capital


def _parse_smaps(text: str, prefixes: Sequence[str]) -> list[ShmMapping]:
    out: list[ShmMapping] = []
    current: ShmMapping | None = None
    values: dict[str, int] = {}

    def flush() -> None:
        if current is not None:
            out.append(_with_usage(current, values))

    for line in text.splitlines():
        if not line:
            continue
        if line[0] in _HEADER_START:
            flush()
            current = parse_maps_line(line, prefixes) if any(p in line for p in prefixes) else None
            values = {}
        elif current is not None:
            key, _, rest = line.partition(" ")
            attr = _USAGE_KEYS.get(key)
            if attr is not None:
                values[attr] = int(rest.split()[0]) * 1024  # smaps reports kB
    flush()
    return out


def _with_usage(mapping: ShmMapping, values: dict[str, int]) -> ShmMapping:
    usage = Usage(
        rss=values.get("rss", 0),
        shared_hugetlb=values.get("shared_hugetlb", 0),
        private_hugetlb=values.get("private_hugetlb", 0),
        kernel_page_size=values.get("kernel_page_size", 0),
    )
    return ShmMapping(mapping.start, mapping.end, mapping.perms, mapping.offset, mapping.dev,
                      mapping.ino, mapping.kind, mapping.name, usage)  # fmt: skip


# -- one process, grouped by object -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessShm:
    """A process's shm fds and VMAs, read together."""

    pid: int
    fds: tuple[ShmFd, ...]
    mappings: tuple[ShmMapping, ...]


def read_process(
    pid: Pid, prefixes: Sequence[str] = KNOWN_PREFIXES, *, usage: bool = True
) -> ProcessShm:
    """Fds and VMAs of `pid` (smaps only if some VMA matched, to skip the page walk)."""
    fds = shm_fds(pid, prefixes)
    mappings = shm_mappings(pid, prefixes)
    if usage and mappings:
        mappings = shm_mappings(pid, prefixes, usage=True)
    real_pid = os.getpid() if pid == "self" else pid
    return ProcessShm(real_pid, tuple(fds), tuple(mappings))


def check_readable(pid: int) -> None:
    """Raise ProcessNotFoundError / ProcessAccessError now rather than mid-report; a
    missing process's error says what else can hide one (hidepid, a PID namespace)."""
    if pid <= 0:
        raise ProcessNotFoundError(pid)
    for path in (f"/proc/{pid}/fd", f"/proc/{pid}/maps"):
        try:
            if path.endswith("/fd"):
                os.listdir(path)
            else:  # the fds' links need the same ptrace read access as maps
                with open(path, "rb") as f:
                    f.read(1)
        except _GONE:
            raise ProcessNotFoundError(pid, why_not_found(pid)) from None
        except PermissionError:
            raise ProcessAccessError(pid, path) from None


def command_name(pid: Pid) -> str | None:
    """The process's command name (/proc/PID/comm, chosen by the process: escape it
    before printing), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="surrogateescape") as f:
            return f.read().removesuffix("\n")
    except OSError:
        return None


# -- holdings at scale (the exporter) ---------------------------------------------------
#
# `read_process` keeps every fd and VMA and reads smaps (a page-table walk: ~70 ms per
# populated 4 GiB). The exporter needs less per object: its name, the bytes mapped and
# the pages it holds. So maps is parsed in bulk (one regex over the file, keeping only the
# lines that name a prefix), each fd is identified with one syscall where possible, and
# residency is one statx per object (`st_blocks`: the same cost at any size).

Key = tuple[int, int] | bytes  # (st_dev, st_ino); an inode-less anonymous VMA's path

AT_STATX_DONT_SYNC: Final = 0x4000
_STATX_MASK: Final = 0x1 | 0x100 | 0x400  # STATX_TYPE | STATX_INO | STATX_BLOCKS
_CHECK_EVERY: Final = 256  # fds between two looks at the deadline
_NAMES_KEPT: Final = 1 << 20
_ROTATE_EVERY: Final = 16  # complete scans between two clean-ups of the parsed paths
_UNKNOWN: Final[Any] = object()


class Matcher:
    """The shm paths that name one of `prefixes`, and what each says (kind, parsed name).

    Parsed paths are kept from one scan to the next (`next_scan`): a name lives as long
    as its object, so a scrape parses only the names that are new since the last. Only
    the paths the last two scans met are kept, so memory follows what processes hold.
    Not locked: concurrent scans with one Matcher at worst parse a name twice.
    """

    def __init__(self, prefixes: Sequence[str]) -> None:
        if not prefixes or not all(prefixes):
            raise ConfigError("a Matcher needs non-empty prefixes")
        self.prefixes = tuple(prefixes)
        self.needles = tuple(p.encode(errors="surrogateescape") for p in self.prefixes)
        # a maps (or smaps header) line whose path mentions a prefix: start, end, offset,
        # major:minor, inode, path; the regex engine skips every other line
        alternatives = b"|".join(re.escape(n) for n in self.needles)
        self.maps_line = re.compile(
            rb"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) ([0-9a-f]+:[0-9a-f]+) (\d+) +"
            rb"([^\n]*?(?:" + alternatives + rb")[^\n]*)$",
            re.MULTILINE,
        )
        self.parsed: dict[bytes, tuple[Kind, ShmName] | None] = {}  # met in this scan
        self._previous: dict[bytes, tuple[Kind, ShmName] | None] = {}
        self.devices: dict[bytes, int] = {}  # maps `major:minor` -> st_dev
        self._scans = 0

    def mentions(self, data: bytes) -> bool:
        """Whether `data` contains any prefix (libc memmem)."""
        return any(_contains(data, n) for n in self.needles)

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

    def device(self, text: bytes) -> int:
        """st_dev of a maps `major:minor` field (few distinct values: cached)."""
        dev = self.devices.get(text)
        if dev is None:
            major, _, minor = text.partition(b":")
            dev = self.devices[text] = os.makedev(int(major, 16), int(minor, 16))
        return dev

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
    one scan: it saves the statx of an object another process measured, and is filled
    with what this read measured. Objects left without pages get them from
    `fill_residency`. `deadline` (a time.monotonic() value) stops the reading part way:
    `complete` is then False. Raises ProcessNotFoundError / ProcessAccessError like the
    other readers.
    """
    data = read_proc_bytes(pid, f"/proc/{pid}/maps")
    objects = _mapped_objects(data, matcher) if matcher.mentions(data) else {}
    if pages:
        for key, obj in objects.items():
            obj.allocated_bytes = pages.get(key)
    unmapped, complete = _held_fds(pid, matcher, objects, deadline, fds_by)
    if pages is not None:
        for key, obj in objects.items():
            if obj.allocated_bytes is not None:
                pages[key] = obj.allocated_bytes
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
    known, lookup = matcher.parsed.get, matcher.lookup
    devices, device = matcher.devices.get, matcher.device
    for start, end, offset, dev, ino, path in matcher.maps_line.findall(data):
        hit = known(path, _UNKNOWN)
        if hit is _UNKNOWN:
            hit = lookup(path)
        if hit is None:
            continue
        key: Key = (devices(dev) or device(dev), int(ino)) if ino != b"0" else path
        lo, hi = int(start, 16), int(end, 16)
        obj = objects.get(key)
        if obj is None:
            objects[key] = HeldObject(hit[0], hit[1], path, 1, hi - lo, hi,
                                      int(offset, 16) + hi - lo)  # fmt: skip
            continue
        # maps is sorted by address: a VMA starting where this object's last one ended,
        # at the next offset in the file, is the rest of one mmap split by madvise
        at = int(offset, 16)
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
) -> tuple[Unmapped, bool]:
    fd_dir = f"/proc/{pid}/fd"
    try:
        dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except _GONE:
        raise ProcessNotFoundError(pid) from None
    except PermissionError:
        raise ProcessAccessError(pid, fd_dir) from None
    try:
        try:  # bytes names: links come back as bytes, as maps paths do
            entries = os.listdir(os.fsencode(fd_dir))
        except _GONE:
            raise ProcessNotFoundError(pid) from None
        except PermissionError:
            raise ProcessAccessError(pid, fd_dir) from None
        reader = _FdReader(pid, fd_dir, dir_fd, matcher, objects)
        with_inode = sum(1 for key in objects if type(key) is tuple)
        if fds_by == "stat" or (fds_by == "auto" and with_inode and 4 * with_inode >= len(entries)):
            return reader.by_stat(entries, deadline)
        return reader.by_link(entries, deadline)
    finally:
        os.close(dir_fd)


class _FdReader:
    """One process's fd directory, read against its mapped objects."""

    def __init__(
        self, pid: Pid, fd_dir: str, dir_fd: int, matcher: Matcher, objects: dict[Key, HeldObject]
    ) -> None:
        self.pid, self.fd_dir, self.dir_fd = pid, fd_dir, dir_fd
        self.matcher, self.objects = matcher, objects
        self.unmapped: Unmapped = {}

    def by_stat(self, entries: list[bytes], deadline: float | None) -> tuple[Unmapped, bool]:
        objects, dir_fd = self.objects, self.dir_fd
        for i, entry in enumerate(entries):
            if deadline is not None and i % _CHECK_EVERY == 0 and time.monotonic() > deadline:
                return self.unmapped, False
            try:
                mode, dev, ino, blocks = stat_fd(dir_fd, entry)
            except _GONE:
                continue  # closed since the listing
            except OSError:
                # its filesystem refused (another user's FUSE mount, a stale NFS handle):
                # its link still names it; a link we may not read closes the process to us
                self._unmapped(entry)
                continue
            obj = objects.get((dev, ino))
            if obj is not None:
                obj.fds += 1
                obj.allocated_bytes = blocks * 512
            elif stat.S_ISREG(mode):  # memfds and shm files are regular files
                self._unmapped(entry)
        return self.unmapped, True

    def by_link(self, entries: list[bytes], deadline: float | None) -> tuple[Unmapped, bool]:
        objects, dir_fd, lookup = self.objects, self.dir_fd, self.matcher.lookup
        needles = self.matcher.needles
        by_path: dict[bytes, list[HeldObject]] = {}  # the fd links that name mapped objects
        for held in objects.values():
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
                    _mode, dev, ino, blocks = stat_fd(dir_fd, entry)
                except _GONE:
                    continue  # closed since the listing
                except OSError:  # its filesystem refused: the name still decides the pool
                    candidates[0].fds += 1
                    continue
                found = objects.get((dev, ino))
                if found is None:
                    self._count(target, candidates[0].name)  # an unmapped namesake
                    continue
                found.allocated_bytes = blocks * 512
                found.fds += 1
            else:
                candidates[0].fds += 1  # same name, same pool
        return self.unmapped, True

    def _link(self, entry: bytes) -> bytes | None:
        try:
            return os.readlink(entry, dir_fd=self.dir_fd)
        except _GONE:
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
    for m in matcher.maps_line.finditer(data):
        _start, _end, _offset, dev, ino, path = m.groups()
        key: Key = (matcher.device(dev), int(ino)) if ino != b"0" else path
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


def stat_fd(dir_fd: int, entry: bytes) -> tuple[int, int, int, int]:
    """(st_mode, st_dev, st_ino, st_blocks) of the object that the fd
    `entry` of an open /proc/PID/fd directory refers to.

    statx(AT_STATX_DONT_SYNC) takes what the kernel has cached: the filesystem is not
    asked to revalidate, so another user's FUSE daemon cannot stall the read by never
    answering, nor a network filesystem by being slow. Plain stat() where libc lacks
    statx. Raises OSError as os.stat does.
    """
    if _statx is None:
        st = os.stat(entry, dir_fd=dir_fd)
        return st.st_mode, st.st_dev, st.st_ino, st.st_blocks
    buf = getattr(_per_thread, "statx", None)
    if buf is None:  # one buffer per thread: scrapes may run side by side
        buf = _per_thread.statx = _Statx()
    if _statx(dir_fd, entry, AT_STATX_DONT_SYNC, _STATX_MASK, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), entry)
    return buf.mode, os.makedev(buf.dev_major, buf.dev_minor), buf.ino, buf.blocks


class _Statx(ctypes.Structure):
    # struct statx (linux/stat.h): the fields read here, the rest padding, 256 bytes
    _fields_ = [
        ("mask", ctypes.c_uint32),
        ("blksize", ctypes.c_uint32),
        ("attributes", ctypes.c_uint64),
        ("nlink", ctypes.c_uint32),
        ("uid", ctypes.c_uint32),
        ("gid", ctypes.c_uint32),
        ("mode", ctypes.c_uint16),
        ("_spare0", ctypes.c_uint16),
        ("ino", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("blocks", ctypes.c_uint64),
        ("attributes_mask", ctypes.c_uint64),
        ("_times", ctypes.c_uint8 * 64),  # atime, btime, ctime, mtime
        ("rdev_major", ctypes.c_uint32),
        ("rdev_minor", ctypes.c_uint32),
        ("dev_major", ctypes.c_uint32),
        ("dev_minor", ctypes.c_uint32),
        ("_rest", ctypes.c_uint8 * 112),
    ]


def _load_statx() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None  # libc without statx (glibc < 2.28)
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                   ctypes.POINTER(_Statx)]  # fmt: skip
    fn.restype = ctypes.c_int
    if fn(-100, b"/", 0, _STATX_MASK, _Statx()) != 0:  # AT_FDCWD; ENOSYS before 4.11
        return None
    return fn


_statx: Any = _load_statx()
_per_thread = threading.local()
