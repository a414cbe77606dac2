"""The calling process's cgroup memory limits, v2 or v1 as the host has them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
        # bytes, lines at "\n" only: the kernel writes a cgroup's name as it is, and a
        # delegated cgroup's name (\r, \x0b, \x85...) must not end a line
        text = Path("/proc/self/cgroup").read_bytes().decode(errors="surrogateescape")
    except FileNotFoundError:
        return paths  # no cgroups here
    for line in filter(None, text.split("\n")):
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
    if "memory" in paths:  # v1
        dirs = _ancestors(CGROUP_ROOT / "memory", paths["memory"])
        return _tightest(
            dirs,
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            lambda v: int(v) >= _V1_UNLIMITED,  # no limit here: its usage need not be read
        )
    if "" in paths:  # v2
        dirs = _ancestors(_v2_dir(), paths[""])
        return _tightest(dirs, "memory.max", "memory.current", lambda v: v == "max")
    return None


def _tightest(
    dirs: Iterable[Path], limit_file: str, usage_file: str, unlimited: Callable[[str], bool]
) -> MemoryLimit | None:
    """The limit with the least room among `dirs`; a limit that is `unlimited` is skipped
    without reading its usage."""
    best: MemoryLimit | None = None
    for d in dirs:
        limit = _read(d / limit_file)
        if limit is None or unlimited(limit):
            continue
        usage = _read(d / usage_file)
        if usage is None:
            continue
        cand = MemoryLimit(int(limit), int(usage), str(d / limit_file))
        if best is None or cand.free < best.free:
            best = cand
    return best


def hugetlb_limit(page_label: str) -> MemoryLimit | None:
    """The hugetlb cgroup limit for one page size ("2MB", "1GB"), v2 or v1."""
    paths = _own_paths()
    if "hugetlb" in paths:
        dirs = _ancestors(CGROUP_ROOT / "hugetlb", paths["hugetlb"])
        files = (f"hugetlb.{page_label}.limit_in_bytes", f"hugetlb.{page_label}.usage_in_bytes")
    elif "" in paths:
        dirs = _ancestors(_v2_dir(), paths[""])
        files = (f"hugetlb.{page_label}.max", f"hugetlb.{page_label}.current")
    else:
        return None
    return _tightest(dirs, *files, _hugetlb_unlimited)


def _hugetlb_unlimited(value: str) -> bool:
    return value == "max" or int(value) >= _V1_UNLIMITED


def _ancestors(base: Path, rel: str) -> list[Path]:
    parts = [p for p in rel.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
