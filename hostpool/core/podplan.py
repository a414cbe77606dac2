"""What a pod needs for its host pools, and whether this node can give it.

`hostpool doctor --kubernetes` prints both. The pools come from a serve config
(`needs_from_pools`) or an engine's command line (`hostpool.core.enginecmd`); each is a
`PoolNeed`: how many bytes, where they live, which pages. From them:

- `pod_resources`: the container's resources and the /dev/shm volume, as a strategic
  merge patch of a Deployment's pod template. Memory counts every byte the pod's memory
  cgroup is charged for: shmem (memfds and /dev/shm files are charged to the cgroup that
  first touches their pages) and anonymous memory, plus the engine's own. hugetlb pages
  are charged to the hugetlb controller instead (`hugepages-2Mi`, requests equal to
  limits as Kubernetes requires); a `prefer` pool falls back to normal pages when the
  node runs out, so memory covers it too. The emptyDir's `sizeLimit` is the bytes of the
  /dev/shm files (a Memory emptyDir counts against the memory limit as well).
- `pod_checks`: a pod spec as written (a manifest's Deployment, StatefulSet, DaemonSet,
  Job or Pod: `load_pod`) against them, one `Verdict` each: the container's memory and
  hugepage limits (requests equal), its /dev/shm a Memory emptyDir big enough.
- `node_checks`: the limits of where it runs, one `Verdict` each: /dev/shm's size, the
  cgroup memory limit, free hugepages per NUMA node, RLIMIT_MEMLOCK (pinned pools) and
  vm.max_map_count (one mapping per allocation).
"""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hostpool.base.units import format_size
from hostpool.errors import ConfigError
from hostpool.memory import cgroup, kernel

Backing = Literal["memfd", "devshm", "anon"]
MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
# Kubernetes' names of the hugepage resources it schedules
HUGEPAGE_RESOURCES = {2 << 20: "hugepages-2Mi", 1 << 30: "hugepages-1Gi"}


@dataclass(frozen=True)
class PoolNeed:
    """One pool (or one engine's host cache) as the pod must hold it."""

    name: str
    size_bytes: int
    backing: Backing
    hugepages: str = "off"  # off | prefer | required
    hugepage_size: int = 2 << 20
    pinned: bool = False
    mappings: int = 1  # allocations: each is one mapping
    numa_node: int | None = None
    source: str = ""  # where the figure was read, for people

    @property
    def hugetlb(self) -> bool:
        return self.hugepages != "off"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    check: str
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.check:<16} {self.detail}"


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _quantity(n: int) -> str:
    """A Kubernetes quantity: the largest binary unit that divides it exactly."""
    for unit, scale in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def hugepage_bytes(needs: Iterable[PoolNeed]) -> dict[int, int]:
    """Page size -> bytes of hugetlb pages the pools ask for (whole pages)."""
    out: dict[int, int] = {}
    for need in needs:
        if need.hugetlb:
            size = need.hugepage_size
            out[size] = out.get(size, 0) + _round_up(need.size_bytes, size)
    return out


def memory_bytes(needs: Iterable[PoolNeed], engine_memory: int, shm_extra: int) -> int:
    """What the pod's memory cgroup is charged for: every pool not held in hugetlb pages
    for sure (`required`), the engine's other /dev/shm files and its own memory."""
    pools = sum(n.size_bytes for n in needs if n.hugepages != "required")
    return engine_memory + shm_extra + pools


def devshm_bytes(needs: Iterable[PoolNeed], shm_extra: int) -> int:
    """The /dev/shm files' bytes and the room the engine's other /dev/shm use needs."""
    return shm_extra + sum(n.size_bytes for n in needs if n.backing == "devshm")


def pinned_bytes(needs: Iterable[PoolNeed]) -> int:
    return sum(n.size_bytes for n in needs if n.pinned)


def pod_resources(
    needs: list[PoolNeed], *, engine_memory: int, shm_extra: int, container: str
) -> dict[str, Any]:
    """The strategic merge patch of a Deployment that gives the pods what `needs` ask
    for: the named container's requests and limits (equal: a Guaranteed pod is not
    evicted for using what it asked for) and a Memory emptyDir `dshm` at /dev/shm."""
    memory = memory_bytes(needs, engine_memory, shm_extra)
    quantities = {}
    if memory:  # a zero limit would start nothing: left to the pod's own
        quantities["memory"] = _quantity(_round_up(memory, 1 << 20))
    for size, total in sorted(hugepage_bytes(needs).items()):
        name = HUGEPAGE_RESOURCES.get(size)
        if name is None:
            raise ConfigError(f"Kubernetes schedules no {format_size(size)} hugepages")
        quantities[name] = _quantity(total)
    shm = devshm_bytes(needs, shm_extra)
    dshm: dict[str, str] = {"medium": "Memory"}
    if shm:
        dshm["sizeLimit"] = _quantity(_round_up(shm, 1 << 20))
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": container,
                "resources": {"requests": dict(quantities), "limits": dict(quantities)},
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            }
        ],
        "volumes": [{"name": "dshm", "emptyDir": dshm}],
    }
    return {"spec": {"template": {"spec": spec}}}


_QUANTITY = re.compile(r"([0-9.]+(?:[eE][-+]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?")
_SUFFIX = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_SUFFIX.update({f"{s}i": float(1 << (10 * (i + 1))) for i, s in enumerate("KMGTPE")})


def quantity_bytes(text: object) -> int:
    """A Kubernetes quantity ("116Gi", "64G", "129e6", 1024) as bytes (ConfigError)."""
    match = _QUANTITY.fullmatch(str(text).strip())
    if match is None:
        raise ConfigError(f"not a Kubernetes quantity: {text!r}")
    return int(float(match.group(1)) * _SUFFIX[match.group(2)] + 0.5)


def load_pod(path: str) -> dict[str, Any]:
    """The pod spec of the first workload in a manifest file (YAML, several documents
    allowed): a Pod's `spec`, or the `spec.template.spec` of a Deployment and the like."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            documents = list(yaml.safe_load_all(f))
    except OSError as exc:
        raise ConfigError(f"--pod {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--pod {path}: not YAML ({exc})".replace("\n", " ")) from None
    for doc in documents:
        spec = doc.get("spec") if isinstance(doc, dict) else None
        if isinstance(spec, dict) and doc.get("kind") != "Pod":
            spec = (spec.get("template") or {}).get("spec")
        if isinstance(spec, dict) and isinstance(spec.get("containers"), list):
            return spec
    raise ConfigError(f"--pod {path}: no Pod, or workload with a pod template, in it")


def pod_container(pod: Mapping[str, Any] | None, name: str | None) -> str:
    """The engine container's name: `name`, which the pod must have, or else the pod's
    only container (ConfigError: a patch for a container the pod lacks would add a
    second container with no image)."""
    names = [c.get("name") for c in (pod or {}).get("containers", [])]
    if name is not None and (pod is None or name in names):
        return name
    if name is None and len(names) == 1:
        return str(names[0])
    if name is None:
        raise ConfigError(
            "--container NAME is required: the engine's container"
            + (f" (the pod has {', '.join(map(str, names))})" if names else "")
        )
    raise ConfigError(f"--container {name}: the pod has no such container ({', '.join(names)})")


def pod_checks(
    pod: Mapping[str, Any],
    container: str,
    needs: list[PoolNeed],
    *,
    engine_memory: int,
    shm_extra: int,
) -> list[Verdict]:
    """The pod spec as written against what `needs` ask for, one verdict each: the
    container's memory and hugepage limits, requests equal to limits, and /dev/shm."""
    (spec,) = [c for c in pod["containers"] if c.get("name") == container]
    resources = spec.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    want = {"memory": _round_up(memory_bytes(needs, engine_memory, shm_extra), 1 << 20)}
    for size, total in sorted(hugepage_bytes(needs).items()):
        want[HUGEPAGE_RESOURCES.get(size, f"hugepages-{format_size(size)}")] = total
    verdicts = []
    for name, need in want.items():
        have = quantity_bytes(limits[name]) if name in limits else None
        detail = f"{format_size(need)} needed, limit " + (
            "none" if have is None else format_size(have)
        )
        verdicts.append(Verdict(have is not None and have >= need, f"pod {name}", detail))
    unequal = sorted(k for k in limits if k in want and requests.get(k) != limits[k])
    verdicts.append(
        Verdict(
            not unequal,
            "pod requests",
            "equal to limits" if not unequal else f"differ from limits: {', '.join(unequal)}",
        )
    )
    verdicts.append(_devshm_verdict(pod, spec, devshm_bytes(needs, shm_extra)))
    return verdicts


def _devshm_verdict(pod: Mapping[str, Any], spec: Mapping[str, Any], want: int) -> Verdict:
    """A Memory emptyDir mounted at /dev/shm whose sizeLimit holds `want` bytes."""
    mounts = [m for m in spec.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"]
    names = {m.get("name") for m in mounts}
    volumes: list[dict[str, Any]] = [v for v in pod.get("volumes") or [] if v.get("name") in names]
    empty = (volumes[0].get("emptyDir") if volumes else None) or {}
    if empty.get("medium") != "Memory":
        return Verdict(
            want == 0, "pod /dev/shm", f"{format_size(want)} needed, no Memory emptyDir there"
        )
    limit = quantity_bytes(empty["sizeLimit"]) if "sizeLimit" in empty else None
    said = (
        "no sizeLimit (the pod's memory limit bounds it)" if limit is None else format_size(limit)
    )
    return Verdict(
        limit is None or limit >= want, "pod /dev/shm", f"{format_size(want)} needed, {said}"
    )


def free_hugepages_per_node(page_size: int) -> dict[int, int]:
    """NUMA node -> free hugetlb pages of that size (empty without NUMA in /sys)."""
    out = {}
    for node in kernel.numa_nodes():
        path = kernel.NUMA_NODES / f"node{node}/hugepages/hugepages-{page_size // 1024}kB"
        try:
            out[node] = int((path / "free_hugepages").read_text())
        except (OSError, ValueError):
            continue
    return out


def _map_count_limit() -> int | None:
    try:
        return int(MAX_MAP_COUNT.read_text())
    except (OSError, ValueError):
        return None


def node_checks(
    needs: list[PoolNeed],
    *,
    engine_memory: int,
    shm_extra: int,
    shm_dir: str = "/dev/shm",
) -> list[Verdict]:
    """The limits of this node (or pod) against what `needs` ask for, one verdict each."""
    verdicts = []
    want_shm = devshm_bytes(needs, shm_extra)
    st = os.statvfs(shm_dir)
    shm_size = st.f_blocks * st.f_frsize
    verdicts.append(
        Verdict(
            shm_size >= want_shm,
            "/dev/shm size",
            f"{format_size(want_shm)} needed, {shm_dir} is {format_size(shm_size)}",
        )
    )
    want_memory = memory_bytes(needs, engine_memory, shm_extra)
    limit = cgroup.memory_limit()
    verdicts.append(
        Verdict(True, "cgroup memory", f"{format_size(want_memory)} needed, no limit here")
        if limit is None
        else Verdict(
            limit.limit >= want_memory,
            "cgroup memory",
            f"{format_size(want_memory)} needed, limit {format_size(limit.limit)} ({limit.source})",
        )
    )
    for size, total in sorted(hugepage_bytes(needs).items()):
        verdicts.append(_hugepage_verdict(needs, size, total // size))
    pinned = pinned_bytes(needs)
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    unlimited = soft == resource.RLIM_INFINITY
    verdicts.append(
        Verdict(
            unlimited or soft >= pinned,
            "ulimit -l",
            f"{format_size(pinned)} pinned, RLIMIT_MEMLOCK "
            + ("unlimited" if unlimited else format_size(soft)),
        )
    )
    mappings = sum(n.mappings for n in needs)
    max_maps = _map_count_limit()
    verdicts.append(
        Verdict(
            max_maps is None or max_maps >= mappings,
            "vm.max_map_count",
            f"{mappings} mappings for the pools, limit "
            + ("unreadable" if max_maps is None else str(max_maps)),
        )
    )
    return verdicts


def _hugepage_verdict(needs: list[PoolNeed], size: int, pages: int) -> Verdict:
    """Enough free pages for the `required` pools (a `prefer` pool falls back to normal
    pages, which memory covers); a pool bound to a NUMA node takes them from that node."""
    per_node = free_hugepages_per_node(size)
    pool = kernel.hugepage_pool(size)
    free = pool.available if pool is not None else 0
    mine = [n for n in needs if n.hugetlb and n.hugepage_size == size]
    required = [n for n in mine if n.hugepages == "required"]
    ok = free >= sum(-(-n.size_bytes // size) for n in required)
    for need in required:
        if need.numa_node is not None:
            ok = ok and per_node.get(need.numa_node, 0) >= -(-need.size_bytes // size)
    nodes = ", ".join(f"node{n} {f}" for n, f in sorted(per_node.items())) or "no NUMA info"
    detail = f"{pages} pages needed, {free} free ({nodes})"
    if free < pages and len(required) < len(mine):
        detail += "; the prefer pools fall back to normal pages"
    return Verdict(ok, f"hugepages {format_size(size)}", detail)


def as_json(
    needs: list[PoolNeed], patch: Mapping[str, Any], verdicts: list[Verdict]
) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": n.name,
                "size_bytes": n.size_bytes,
                "backing": n.backing,
                "hugepages": n.hugepages,
                "hugepage_size": n.hugepage_size,
                "pinned": n.pinned,
                "mappings": n.mappings,
                "numa_node": n.numa_node,
                "source": n.source,
            }
            for n in needs
        ],
        "patch": patch,
        "checks": [{"ok": v.ok, "check": v.check, "detail": v.detail} for v in verdicts],
        "ok": all(v.ok for v in verdicts),
    }
