"""What the host view says: objects, who holds them, and the totals that close against
/proc/meminfo `Shmem`. Plain frozen data; `as_json()` gives the `hostpool shm --json`
shape (the contract in DESIGN.md's "host view")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ObjectKind = Literal["memfd", "file", "sysv", "anon_shared"]
OBJECT_KINDS: tuple[ObjectKind, ...] = ("memfd", "file", "sysv", "anon_shared")

Engine = Literal[
    "hostpool", "sglang", "vllm", "kvcached", "mooncake", "lmcache", "torch", "python", "unknown"
]
ENGINES: tuple[Engine, ...] = (
    "hostpool",
    "sglang",
    "vllm",
    "kvcached",
    "mooncake",
    "lmcache",
    "torch",
    "python",
    "unknown",
)

HoldState = Literal["held", "orphaned"]

# Where a tmpfs or hugetlbfs file lives (DESIGN.md, "The host view"): `dev_shm` a tmpfs
# mounted at some mount namespace's /dev/shm (or a container sandbox's shm mount),
# `empty_dir` a kubelet Memory emptyDir, `hugetlbfs`, `kubelet_volume` kubelet's secret,
# projected, downward-API and configMap tmpfs volumes, `system` every other tmpfs (/run,
# /tmp, ...). memfd, sysv and anon_shared objects have no area (None).
Area = Literal["dev_shm", "empty_dir", "hugetlbfs", "kubelet_volume", "system"]
AREAS: tuple[Area, ...] = ("dev_shm", "empty_dir", "hugetlbfs", "kubelet_volume", "system")
# The only areas whose files can be orphans: shared memory someone made and left.
ORPHAN_AREAS: frozenset[Area] = frozenset({"dev_shm", "empty_dir", "hugetlbfs"})

# (st_dev, st_ino) of the object's inode: one object per identity, across namespaces
Identity = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Holder:
    """One process holding an object: by `fds` open file descriptors, `mappings` maps
    (its threads' own fd tables and memory included). `pod_uid`, `container_id`: the
    Kubernetes pod and container the process runs in, where its cgroup says so."""

    pid: int
    comm: str
    fds: int
    mappings: int
    pod_uid: str | None = None
    container_id: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "comm": self.comm,
            "fds": self.fds,
            "mappings": self.mappings,
            "pod_uid": self.pod_uid,
            "container_id": self.container_id,
        }


@dataclass(frozen=True, slots=True)
class HostObject:
    """One shared-memory object. `path` is one this process can open or unlink it by (a
    file in another mount namespace: through `/proc/PID/root`), None for memfd,
    anon_shared and sysv. `orphan`: no process holds an fd or a mapping (sysv: no
    attachment); memfds and anonymous shared memory are never orphans (they die with
    their last holder), and a file is one only in an area of `ORPHAN_AREAS`. `hugetlb`:
    backed by hugetlb pages (not counted in `Shmem`). `area`: where a file lives (None for
    the other kinds); `links`: a file's hard links (None for the other kinds);
    `pod_uid`/`container_id`: the pod and container it belongs to where the node says so
    (its holders' cgroups, a kubelet volume's path, or the mount namespace an unheld file
    was found through)."""

    kind: ObjectKind
    name: str
    path: str | None
    engine: Engine
    pool: str | None
    size_bytes: int
    resident_bytes: int
    holders: tuple[Holder, ...]
    orphan: bool
    age_seconds: float | None
    identity: Identity | None = None
    shmid: int | None = None
    hugetlb: bool = False
    area: Area | None = None
    links: int | None = None
    pod_uid: str | None = None
    container_id: str | None = None

    @property
    def state(self) -> HoldState:
        return "orphaned" if self.orphan else "held"

    def as_json(self) -> dict[str, Any]:
        """Exactly the documented keys (`links` for files only, `shmid` for sysv only)."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "name": self.name,
            "path": self.path,
            "area": self.area,
            "engine": self.engine,
            "pool": self.pool,
            "size_bytes": self.size_bytes,
            "resident_bytes": self.resident_bytes,
            "holders": [h.as_json() for h in self.holders],
            "pod_uid": self.pod_uid,
            "container_id": self.container_id,
            "orphan": self.orphan,
            "age_seconds": self.age_seconds,
        }
        if self.kind == "file":
            out["links"] = self.links
        if self.kind == "sysv":
            out["shmid"] = self.shmid
        return out


@dataclass(frozen=True, slots=True)
class HostTotals:
    """`shmem_bytes` is /proc/meminfo `Shmem`; `attributed_bytes` the resident bytes of
    the non-hugetlb objects found; `unattributed_bytes` = max(0, shmem - attributed);
    `orphaned_bytes` the resident bytes of non-hugetlb orphans. Hugetlb objects are not
    `Shmem`: their own totals."""

    shmem_bytes: int
    attributed_bytes: int
    unattributed_bytes: int
    orphaned_bytes: int
    hugetlb_bytes: int
    hugetlb_orphaned_bytes: int

    def as_json(self) -> dict[str, Any]:
        return {
            "shmem_bytes": self.shmem_bytes,
            "attributed_bytes": self.attributed_bytes,
            "unattributed_bytes": self.unattributed_bytes,
            "orphaned_bytes": self.orphaned_bytes,
            "hugetlb": {
                "bytes": self.hugetlb_bytes,
                "orphaned_bytes": self.hugetlb_orphaned_bytes,
            },
        }


@dataclass(frozen=True, slots=True)
class HostView:
    """One scan of the host: every object found and the totals. `unreadable`: processes
    this user may not read (their holdings are missing: objects only they hold look
    orphaned); `complete`: False whenever anything was skipped for a reason other than
    ENOENT (a deadline, EMFILE, EACCES on a directory, a mount not walked, ...);
    `truncated_phase`: the phase whose time budget ran out (`host/bounds`: mountinfo,
    processes, tmpfs, sysv), None when none did."""

    objects: tuple[HostObject, ...]
    totals: HostTotals
    unreadable: int = 0
    complete: bool = True
    truncated_phase: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "objects": [o.as_json() for o in self.objects],
            "totals": self.totals.as_json(),
            "unreadable_processes": self.unreadable,
            "complete": self.complete,
        }
