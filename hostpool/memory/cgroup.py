"""The calling process's cgroup memory limits, v2 or v1 as the host has them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 reports "no limit" as a page-rounded LONG_MAX.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    limit: int
    usage: int
    source: str  # the file that set the limit, for messages

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage)


def _own_paths() -> dict[str, str]:
    """controller -> cgroup path ("" for the v2 unified entry), read on every call: a
    process moved to another cgroup must be admitted against that one."""
    paths: dict[str, str] = {}
    try:
        text = Path("/proc/self/cgroup").read_text()
    except FileNotFoundError:
        return paths  # no cgroups here
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    return paths


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_dir() -> Path:
    unified = CGROUP_ROOT / "unified"
    return unified if (unified / "cgroup.controllers").exists() else CGROUP_ROOT


def memory_limit() -> MemoryLimit | None:
    """The tightest memory limit among this cgroup and its ancestors, or None."""
    paths = _own_paths()
    best: MemoryLimit | None = None
    if "memory" in paths:  # v1
        base = CGROUP_ROOT / "memory"
        for d in _ancestors(base, paths["memory"]):
            limit = _read(d / "memory.limit_in_bytes")
            if limit is None or int(limit) >= _V1_UNLIMITED:
                continue  # no limit here: its usage need not be read
            usage = _read(d / "memory.usage_in_bytes")
            if usage is None:
                continue
            cand = MemoryLimit(int(limit), int(usage), str(d / "memory.limit_in_bytes"))
            if best is None or cand.free < best.free:
                best = cand
        return best
    if "" in paths:  # v2
        for d in _ancestors(_v2_dir(), paths[""]):
            limit = _read(d / "memory.max")
            if limit is None or limit == "max":
                continue
            usage = _read(d / "memory.current")
            if usage is None:
                continue
            cand = MemoryLimit(int(limit), int(usage), str(d / "memory.max"))
            if best is None or cand.free < best.free:
                best = cand
    return best


def hugetlb_limit(page_label: str) -> MemoryLimit | None:
    """The hugetlb cgroup limit for one page size ("2MB", "1GB"), v2 or v1."""
    paths = _own_paths()
    candidates: list[tuple[Path, str, str]] = []
    if "hugetlb" in paths:
        base = CGROUP_ROOT / "hugetlb"
        for d in _ancestors(base, paths["hugetlb"]):
            candidates.append(
                (d, f"hugetlb.{page_label}.limit_in_bytes", f"hugetlb.{page_label}.usage_in_bytes")
            )
    elif "" in paths:
        for d in _ancestors(_v2_dir(), paths[""]):
            candidates.append((d, f"hugetlb.{page_label}.max", f"hugetlb.{page_label}.current"))
    best: MemoryLimit | None = None
    for d, limit_file, usage_file in candidates:
        limit, usage = _read(d / limit_file), _read(d / usage_file)
        if limit is None or usage is None or limit == "max" or int(limit) >= _V1_UNLIMITED:
            continue
        cand = MemoryLimit(int(limit), int(usage), str(d / limit_file))
        if best is None or cand.free < best.free:
            best = cand
    return best


def _ancestors(base: Path, rel: str) -> list[Path]:
    parts = [p for p in rel.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
