"""The node view's sums, made as the scan finds objects (`HostSums`, a `host.sink`
sink): one counter per label combination, nothing per object. A file no process holds
is summed from its facts (name, lstat, area, mount's pod) without any object built for
it, so a scrape's memory does not grow with the files on a tmpfs (docs/host-view.md
gives the figures). `view_samples` sums a view already made the same way.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Final

from hostpool.host.model import (
    AREAS,
    ENGINES,
    OBJECT_KINDS,
    ORPHAN_AREAS,
    Area,
    HoldState,
    HostObject,
    HostTotals,
    HostView,
)
from hostpool.host.pods import PodRef
from hostpool.host.sink import Tally, naming, newest

STATES: Final[tuple[HoldState, ...]] = ("held", "orphaned")
Samples = dict[str, dict[tuple[str, ...], float]]
_ORDERS: Final = tuple({v: i for i, v in enumerate(values)} for values in
                       (ENGINES, OBJECT_KINDS, STATES, ("", *AREAS)))  # fmt: skip


def _rank(key: tuple[str, ...]) -> tuple[object, ...]:
    """A series' place: the fixed sets' order, then the pod's uid."""
    return (*(order[v] for order, v in zip(_ORDERS, key, strict=False)), *key[len(_ORDERS) :])


class HostSums:
    """Sums by the node view's labels (metrics/host's families), fed object by object."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() if now is None else now
        self.shm: defaultdict[tuple[str, ...], int] = defaultdict(int)
        self.count: defaultdict[tuple[str, ...], int] = defaultdict(int)
        self.huge: defaultdict[tuple[str, ...], int] = defaultdict(int)
        self.oldest: dict[str, float] = {}
        self.tally = Tally()
        self.objects = 0

    def add(self, obj: HostObject) -> None:
        self._sum(obj.engine, obj.kind, obj.orphan, obj.area, obj.pod_uid,
                  obj.resident_bytes, obj.hugetlb, obj.age_seconds)  # fmt: skip

    def add_file(
        self, name: str, path: str, st: os.stat_result, area: Area, hugetlb: bool, pod: PodRef
    ) -> None:
        engine = naming(name.rpartition("/")[2])[0]
        age = max(0.0, self.now - newest(st))
        self._sum(engine, "file", area in ORPHAN_AREAS, area, pod.pod_uid,
                  st.st_blocks * 512, hugetlb, age)  # fmt: skip

    def _sum(self, engine: str, kind: str, orphan: bool, area: str | None, pod: str | None,
             resident: int, hugetlb: bool, age: float | None) -> None:  # fmt: skip
        self.objects += 1
        self.tally.count(resident, hugetlb, orphan)
        state = "orphaned" if orphan else "held"
        if hugetlb:
            self.huge[(engine, kind, state)] += resident
        else:
            key = (engine, kind, state, area or "", pod or "")
            self.shm[key] += resident
            self.count[key] += 1
        if orphan and age is not None:
            self.oldest[engine] = max(self.oldest.get(engine, 0.0), age)

    def samples(self, totals: HostTotals) -> Samples:
        """The object and total families' samples, {name: {label values: value}}, in
        the fixed sets' order (pods by uid); only combinations that have objects."""
        shm, count, huge, oldest = self.shm, self.count, self.huge, self.oldest
        return {
            "hostpool_host_shm_bytes": {k: float(shm[k]) for k in sorted(count, key=_rank)},
            "hostpool_host_shm_objects": {k: float(count[k]) for k in sorted(count, key=_rank)},
            "hostpool_host_hugetlb_bytes": {k: float(huge[k]) for k in sorted(huge, key=_rank)},
            "hostpool_host_shmem_bytes": {(): float(totals.shmem_bytes)},
            "hostpool_host_shmem_unattributed_bytes": {(): float(totals.unattributed_bytes)},
            "hostpool_host_shm_oldest_orphan_age_seconds": {
                (engine,): oldest[engine] for engine in ENGINES if engine in oldest
            },
        }


def view_samples(view: HostView) -> Samples:
    """The samples of a view already made (its objects summed, its totals as they are)."""
    sums = HostSums()
    for obj in view.objects:
        sums.add(obj)
    return sums.samples(view.totals)
