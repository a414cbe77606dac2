"""What this host supports, probed with the same code the allocators run.

`hostpool doctor` prints it; `--hugepages required` or `--need 64GiB` turn it into a
check that fails (exit 1) when the host cannot meet the request.
"""

from __future__ import annotations

import os
import platform
import resource
from typing import Any

from hostpool.base.units import format_size
from hostpool.errors import AllocationError
from hostpool.memory import cgroup, cuda, kernel, thp
from hostpool.memory.create import choose_populate
from hostpool.memory.hugepages import plan_hugepages, thp_choice
from hostpool.memory.options import RegionOptions


def _limit(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY else value


def facts(shm_dir: str = "/dev/shm") -> dict[str, Any]:
    """Every fact doctor reports, as plain JSON-ready values."""
    meminfo = kernel.meminfo()
    st = os.statvfs(shm_dir)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = cgroup.memory_limit()
    return {
        "kernel": platform.release(),
        "memfd": kernel.probe_memfd(),
        "mfd_noexec_seal": kernel.probe_noexec_seal(),
        "sealing": kernel.probe_sealing(),
        "madv_populate_write": kernel.probe_madv_populate_write(),
        "memory": {
            "total_bytes": meminfo.get("MemTotal", 0),
            "available_bytes": meminfo.get("MemAvailable", 0),
            "shmem_bytes": meminfo.get("Shmem", 0),
        },
        "hugepages": {
            format_size(size): {
                "page_size": size,
                "total": pool.total,
                "free": pool.free,
                "reserved": pool.reserved,
                "surplus": pool.surplus,
                "available": pool.available,
            }
            for size, pool in sorted(kernel.hugepage_pools().items())
        },
        "thp": _thp_facts(),
        "dev_shm": {
            "path": shm_dir,
            "size_bytes": st.f_blocks * st.f_frsize,
            "free_bytes": st.f_bavail * st.f_frsize,
        },
        "rlimits": {
            "nofile": {"soft": _limit(nofile[0]), "hard": _limit(nofile[1])},
            "memlock": {"soft": _limit(memlock[0]), "hard": _limit(memlock[1])},
        },
        "cgroup_memory": (
            None
            if limit is None
            else {"limit_bytes": limit.limit, "usage_bytes": limit.usage, "source": limit.source}
        ),
        "cuda": cuda.get_runtime().available(),
        "numa_nodes": kernel.numa_nodes(),
    }


def _thp_facts() -> dict[str, Any]:
    f = thp.read_facts()
    return {
        "shmem_enabled": f.shmem_enabled,
        "enabled": f.enabled,
        "defrag": f.defrag,
        "reporting_order": f.reporting_order,
        "free_hugepage_bytes": f.free_hugepage_bytes,
    }


def thp_choices(need: int) -> dict[str, dict[str, Any]]:
    """The allocators' own THP choice for shm and mmap regions of `need` bytes (1 GiB
    when no size is given): the step `hugepages="prefer"` reaches without hugetlb."""
    facts = thp.read_facts()
    out = {}
    for kind in ("shm", "mmap"):
        choice = thp_choice(kind, need or THP_EXAMPLE_BYTES, facts)
        out[kind] = {
            "advise": choice.advise,
            "avoid": choice.avoid,
            "reason": choice.reason,
            "why": choice.why,
        }
    return out


THP_EXAMPLE_BYTES = 1 << 30


def plan(hugepages: str, hugepage_size: object, need: int) -> dict[str, Any]:
    """What a shm allocation of `need` bytes would get with these options, and whether
    it can be met (the allocators' own planning code, nothing re-implemented)."""
    options = RegionOptions.parse(hugepages=hugepages, hugepage_size=hugepage_size)
    backend = "memfd" if kernel.probe_memfd() else "devshm"
    result: dict[str, Any] = {
        "hugepages": hugepages,
        "hugepage_size": options.hugepage_size,
        "need_bytes": need,
        "backend": backend,
        "populate": choose_populate("auto", fd_backed=True),
        "thp_choice": thp_choices(need),
    }
    problems: list[str] = []
    try:
        chosen = plan_hugepages("shm", backend, need, options)
        result["page_size"] = chosen.hugetlb_size or os.sysconf("SC_PAGE_SIZE")
        result["thp"] = chosen.thp
        result["fallbacks"] = list(chosen.fallbacks)
    except AllocationError as exc:
        problems.append(str(exc))
    if need and result.get("page_size") == os.sysconf("SC_PAGE_SIZE"):
        available = kernel.meminfo().get("MemAvailable", 0)
        if need > available:
            problems.append(
                f"need {format_size(need)} but MemAvailable is {format_size(available)}"
            )
        limit = cgroup.memory_limit()
        if limit is not None and need > limit.free:
            problems.append(
                f"need {format_size(need)} but the cgroup allows {format_size(limit.free)} more"
            )
        if backend == "devshm":
            st = os.statvfs("/dev/shm")
            if need > st.f_bavail * st.f_frsize:
                free = st.f_bavail * st.f_frsize
                problems.append(
                    f"need {format_size(need)} but /dev/shm has {format_size(free)} free"
                )
    result["ok"] = not problems
    result["problems"] = problems
    return result
