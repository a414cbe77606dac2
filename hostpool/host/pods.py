"""Which Kubernetes pod and container own a process, a tmpfs mount and a host object, as
the node itself says it (never an API server): a process's `/proc/PID/cgroup`, a kubelet
volume's path, and the mount namespaces that show a mount.

- A process: the first line of its cgroup file (v1 `N:controllers:/path`, v2 `0::/path`)
  whose path names a pod. The kubelet's systemd cgroup driver names a pod's slice
  `kubepods[-besteffort|-burstable]-pod<uid, '-' written '_'>.slice` (under
  `kubepods.slice`, or with a prefix: `kubelet-kubepods-...` in kind), the cgroupfs driver
  `pod<uid>` below a `kubepods` directory; the component after the pod's is the
  container's: `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope`
  (systemd) or `<id>` (cgroupfs), 64 hex digits. A reader in another cgroup namespace sees
  the path relative to its own root (`/../../kubepods...`): only components are matched.
  A line with both is preferred to one naming the pod only (CRI-O's `crio-conmon-<id>`
  monitor, a pod's slice itself).
- A mount: `<kubelet root>/pods/<uid>/volumes/<plugin>/<name>` (secret, projected,
  configMap, downward-API and Memory emptyDir tmpfs volumes; any kubelet root: only the
  `/pods/<uid>/volumes/` part is matched), else the pod of the processes whose mount
  namespace shows it where it is not covered by another mount (a container's /dev/shm,
  reached only through its namespace; not the node's /dev/shm its own one covers).
- An object: its holders' pod where they all agree; an unheld file's (or one whose holders
  are in no pod), its mount's. Holders of different pods, or several sources that
  disagree: no pod (None), never a guess; `container_id` likewise, on its own (a pod's
  /dev/shm that two containers hold has the pod and no container).

`Pods` reads each process's cgroup file once per scan (a scan makes one) and parses each
distinct content once per process lifetime (most processes of a container share it).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from hostpool.host import mountinfo
from hostpool.host.bounds import LOCAL_FSTYPES, Budget, unsafe_on_the_way
from hostpool.host.model import Holder, HostObject
from hostpool.host.mounts import POD_UID, KubeletVolume, Namespaces, kubelet_volume

__all__ = ["NO_POD", "KubeletVolume", "PodRef", "Pods", "kubelet_volume", "parse_cgroup"]

# a pod's systemd slice (the driver's escaping writes a uid's '-' as '_'), or cgroupfs' dir
_SYSTEMD_POD: Final = re.compile(
    rf"(?:[a-z0-9]+-)*kubepods(?:-besteffort|-burstable)?-pod({POD_UID})\.slice"
)
_CGROUPFS_POD: Final = re.compile(rf"pod({POD_UID})")
_CONTAINER: Final = re.compile(r"(?:(?:cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?")


@dataclass(frozen=True, slots=True)
class PodRef:
    """A pod's uid (as Kubernetes writes it, with '-') and a container's id (64 hex
    digits); None where the node does not say."""

    pod_uid: str | None
    container_id: str | None


NO_POD: Final = PodRef(None, None)


@lru_cache(maxsize=4096)
def parse_cgroup(data: bytes) -> PodRef:
    """The pod and container a `/proc/PID/cgroup` content names (see the module's
    docstring); lines split on `\\n` only."""
    if b"kubepods" not in data:
        return NO_POD  # the common case on a host: one substring search
    found = NO_POD
    for line in data.split(b"\n"):
        path = line.split(b":", 2)[-1].decode(errors="replace")
        ref = _pod_of_path(path)
        if ref.container_id is not None:
            return ref
        if found.pod_uid is None:
            found = ref
    return found


def _pod_of_path(path: str) -> PodRef:
    parts = path.split("/")
    for i, part in enumerate(parts):
        m = _SYSTEMD_POD.fullmatch(part)
        if m is None and "kubepods" in parts[:i]:
            m = _CGROUPFS_POD.fullmatch(part)
        if m is None:
            continue
        uid = m.group(1).replace("_", "-")
        container = _CONTAINER.fullmatch(parts[i + 1]) if i + 1 < len(parts) else None
        return PodRef(uid, None if container is None else container.group(1))
    return NO_POD


def _agreed(refs: Iterable[PodRef]) -> PodRef:
    """The pod every ref names (None if they differ or none names one); the container
    likewise, only within that pod."""
    uids = {r.pod_uid for r in refs}
    if len(uids) != 1:
        return NO_POD
    (uid,) = uids
    containers = {r.container_id for r in refs}
    return PodRef(uid, containers.pop() if len(containers) == 1 else None)


class Pods:
    """One scan's answers: processes' pods (each cgroup file read once) and mounts' pods
    by superblock (`st_dev`), from the mount namespaces the scan walked."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._by_pid: dict[int, PodRef] = {}
        self._by_dev: dict[int, PodRef] = {}

    def of_pid(self, pid: int) -> PodRef:
        """The pod and container of process `pid` (NO_POD when gone or unreadable)."""
        ref = self._by_pid.get(pid)
        if ref is None:
            try:
                with open(f"{self._proc}/{pid}/cgroup", "rb") as f:
                    ref = parse_cgroup(f.read())
            except OSError:
                ref = NO_POD
            self._by_pid[pid] = ref
        return ref

    def read_mounts(self, namespaces: Namespaces, budget: Budget | None = None) -> None:
        """The pod of each shared-memory superblock the namespaces' mounts show: a kubelet
        volume's by its path (any namespace), else the pod of every namespace showing it
        that is a pod's (our own through this process), where they agree. Each table is
        read as a stream within `budget` (`host/mountinfo`), a namespace shows a
        superblock if one of its mounts of it is not covered, and no mount point is
        looked up through a mount that may stall (`host/bounds`)."""
        budget = budget if budget is not None else Budget()
        by_path: dict[int, set[PodRef]] = {}
        by_member: dict[int, list[PodRef]] = {}
        members = [("self", os.getpid()), *((str(p), p) for p in namespaces.members.values())]
        for name, pid in members:
            member = self.of_pid(pid)
            ways: dict[int, list[str]] = {}  # a pod's namespace: its mount points of each
            unsafe: set[str] = set()
            try:
                for line in mountinfo.lines(f"{self._proc}/{name}/mountinfo", budget):
                    parsed = mountinfo.parse_line(line)
                    if parsed is None:
                        continue
                    fstype, mountpoint, e = parsed
                    if fstype not in LOCAL_FSTYPES:
                        unsafe.add(mountpoint)
                    if e is None:
                        continue
                    volume = kubelet_volume(e.mountpoint)
                    if volume is not None:
                        by_path.setdefault(e.st_dev, set()).add(PodRef(volume.pod_uid, None))
                    elif member.pod_uid is not None and len(ways.get(e.st_dev, ())) < 8:
                        ways.setdefault(e.st_dev, []).append(e.mountpoint)
            except OSError:
                continue
            root = "" if name == "self" else f"{self._proc}/{pid}/root"
            for dev, points in ways.items():
                if any(unsafe_on_the_way(p, unsafe) is None and _shows(root + p, dev)
                       for p in points):  # fmt: skip
                    by_member.setdefault(dev, []).append(member)
        for dev, refs in by_member.items():
            self._by_dev[dev] = _agreed(refs)
        for dev, volumes in by_path.items():  # a volume's path outranks who mounts it
            self._by_dev[dev] = _agreed(volumes)

    def of_dev(self, dev: int) -> PodRef:
        """The pod of the tmpfs or hugetlbfs superblock `dev` (NO_POD: none or unknown)."""
        return self._by_dev.get(dev, NO_POD)

    def attribute(self, obj: HostObject) -> HostObject:
        """`obj` with its holders' and its own `pod_uid`/`container_id` filled (the same
        object when the node names no pod for it: a host without pods pays a lookup per
        holder)."""
        holders = obj.holders
        of_pid = self.of_pid
        if any(of_pid(h.pid).pod_uid is not None for h in holders):
            refs = [of_pid(h.pid) for h in holders]
            ref = _agreed(refs)
            placed = tuple(_placed(h, r) for h, r in zip(holders, refs, strict=True))
            return dataclasses.replace(
                obj, holders=placed, pod_uid=ref.pod_uid, container_id=ref.container_id
            )
        if not self._by_dev or obj.kind != "file" or obj.identity is None:
            return obj
        ref = self._by_dev.get(obj.identity[0], NO_POD)
        if ref.pod_uid is None:
            return obj
        return dataclasses.replace(obj, pod_uid=ref.pod_uid, container_id=ref.container_id)


def _shows(path: str, dev: int) -> bool:
    """Whether `path` reaches the mount `dev` (not one covered by a later mount: the
    node's /dev/shm under a container's own)."""
    try:
        return os.stat(path).st_dev == dev
    except OSError:
        return False


def _placed(h: Holder, ref: PodRef) -> Holder:
    if ref.pod_uid is None:
        return h
    return dataclasses.replace(h, pod_uid=ref.pod_uid, container_id=ref.container_id)
