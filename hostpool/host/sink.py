"""Where a host scan puts what it finds, as it finds it (`ObjectSink`), so that its
memory is bounded by what processes hold, never by the files on a tmpfs.

A scan hands each object that processes hold, each memfd, anonymous shared region and
SysV segment to `add` as a `HostObject`, and each file no process holds (the bulk on a
busy node: a million files in one /dev/shm) to `add_file` as its facts: no object is
built for it unless the sink builds one. `Collected` keeps the view (`hostpool shm`,
`reap`); the exporter's aggregator (`metrics/hostsum`) only sums. Both count the
totals with a `Tally`. Also here: an object as the scan sees it (`Seen`) and the one
constructor of a `HostObject` from it (`make_object`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

from hostpool.host.engines import engine_of, pool_of
from hostpool.host.model import (
    ORPHAN_AREAS,
    Area,
    Engine,
    Holder,
    HostObject,
    HostTotals,
    Identity,
    ObjectKind,
)
from hostpool.host.pods import PodRef
from hostpool.proc.hostread import PathInfo


class ObjectSink(Protocol):
    """What a scan hands its findings to (see the module); `tally` counts the totals of
    everything handed to it."""

    tally: Tally

    def add(self, obj: HostObject) -> None:
        """An object some process holds, or a memfd, anonymous region, SysV segment."""

    def add_file(
        self, name: str, path: str, st: os.stat_result, area: Area, hugetlb: bool, pod: PodRef
    ) -> None:
        """A regular file on a tmpfs or hugetlbfs mount that no process holds: `name`
        below its mount, `path` to open it by, its lstat, area and pod (by its mount)."""


def newest(st: os.stat_result) -> float:
    """The newest of mtime and ctime: a file restored with old times (cp -a) is new."""
    return max(st.st_mtime, st.st_ctime)


@dataclass(slots=True)
class Seen:
    """One object as the processes read so far hold it."""

    info: PathInfo
    identity: Identity | None
    holders: list[Holder] = field(default_factory=list)
    allocated: int | None = None
    size: int | None = None
    changed: float | None = None  # the newest of its mtime and ctime
    mapped: int = 0
    shared: bool = False
    via: tuple[int, bytes] | None = None  # a VMA of a holder: /proc/TASK/map_files name
    st: os.stat_result | None = None  # through that VMA, where map_files allowed it
    found: bool = False  # met by the tmpfs walk


@lru_cache(maxsize=1 << 14)
def naming(base: str) -> tuple[Engine, str | None]:
    """(engine, pool) of a name (the pool only for hostpool's and sglang's names)."""
    engine = engine_of(base)
    return engine, pool_of(base) if engine in ("hostpool", "sglang") else None


def make_object(kind: ObjectKind, name: str, path: str | None, seen: Seen, now: float, *,
                hugetlb: bool, orphan: bool = False, shmid: int | None = None,
                area: Area | None = None, links: int | None = None) -> HostObject:  # fmt: skip
    """The HostObject of `seen` (every one is built here)."""
    base = name.rpartition("/")[2] if kind == "file" else name  # a memfd's name may hold '/'
    engine, pool = naming(base)
    size = seen.size if seen.size is not None else seen.mapped
    age = None if seen.changed is None else max(0.0, now - seen.changed)
    return HostObject(kind, name, path, engine, pool, size, seen.allocated or 0,
                      tuple(seen.holders), orphan, age, seen.identity, shmid, hugetlb,
                      area, links)  # fmt: skip


def meminfo_shmem() -> int:
    """/proc/meminfo `Shmem`, in bytes."""
    with open("/proc/meminfo", "rb") as f:
        for line in f.read().split(b"\n"):
            if line.startswith(b"Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class Tally:
    """The totals of the objects counted (resident bytes, orphaned ones, hugetlb apart)."""

    attributed: int = 0
    orphaned: int = 0
    hugetlb: int = 0
    hugetlb_orphaned: int = 0

    def count(self, resident: int, hugetlb: bool, orphan: bool) -> None:
        if hugetlb:
            self.hugetlb += resident
            self.hugetlb_orphaned += resident if orphan else 0
        else:
            self.attributed += resident
            self.orphaned += resident if orphan else 0

    def totals(self) -> HostTotals:
        """These sums against `Shmem` read now."""
        shmem = meminfo_shmem()
        return HostTotals(shmem, self.attributed, max(0, shmem - self.attributed),
                          self.orphaned, self.hugetlb, self.hugetlb_orphaned)  # fmt: skip


class Collected:
    """A sink that keeps every object (a HostObject per unheld file too)."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.objects: list[HostObject] = []
        self.tally = Tally()
        self._ints: dict[int, int] = {}

    def _int(self, value: int) -> int:
        """`value` as one int object per distinct value (files' sizes repeat: a page, a
        pool's chunk), not one per file (the first 65,536 distinct values)."""
        if len(self._ints) < 1 << 16:
            return self._ints.setdefault(value, value)
        return self._ints.get(value, value)

    def add(self, obj: HostObject) -> None:
        self.objects.append(obj)
        self.tally.count(obj.resident_bytes, obj.hugetlb, obj.orphan)

    def add_file(
        self, name: str, path: str, st: os.stat_result, area: Area, hugetlb: bool, pod: PodRef
    ) -> None:
        seen = Seen(("file", name), (st.st_dev, st.st_ino), allocated=self._int(st.st_blocks * 512),
                    size=self._int(st.st_size), changed=newest(st))  # fmt: skip
        obj = make_object("file", name, path, seen, self.now, hugetlb=hugetlb,
                          orphan=area in ORPHAN_AREAS, area=area, links=st.st_nlink)  # fmt: skip
        if pod.pod_uid is not None:
            obj = dataclasses.replace(obj, pod_uid=pod.pod_uid, container_id=pod.container_id)
        self.add(obj)
