"""The library example (docs/library.md) runs as written on a 4 GiB host and ends clean.

The block is found by its marker comment, written to a file and run in a fresh interpreter
(inside a cgroup capped at 4 GiB where this host lets the test make one). It must exit 0
with nothing at all on stderr (hostpool logs only warnings when unconfigured: a leak or a
fallback would show there), print `no leaks`, and leave no hostpool memfd or mapping in
the process once it has run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "library.md"
MARKER = "# library example:"
GiB = 1 << 30
CAP = 4 * GiB
HEADROOM = 1 * GiB  # torch, the interpreter and the page cache live beside the pools

# Runs the file as __main__ (exactly its text), then reports what of hostpool is left in
# this process: fds and mappings whose names start with "hostpool.", and its cgroups.
RUNNER = """
import os, runpy, sys
runpy.run_path(sys.argv[1], run_name="__main__")
fds = []
for n in os.listdir("/proc/self/fd"):
    try:
        fds.append(os.readlink(f"/proc/self/fd/{n}"))
    except FileNotFoundError:  # the fd listdir itself held
        pass
with open("/proc/self/maps") as f:
    maps = [line for line in f if "hostpool." in line]
print("LEFT fds", sum("hostpool." in t for t in fds), "maps", len(maps))
with open("/proc/self/cgroup") as f:
    print("CGROUP", ";".join(f.read().split()))
"""


def example() -> str:
    """The page's python block that starts with MARKER (under its title)."""
    readme = PAGE.read_text()
    blocks: list[str] = re.findall(r"^```python\n(.*?)^```$", readme, re.M | re.S)
    found = [b for b in blocks if b.startswith(MARKER)]
    assert len(found) == 1, f"{len(found)} {PAGE.name} python blocks start with {MARKER!r}"
    return found[0]


def _own_v1_memory_dir() -> Path | None:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if "memory" in controllers.split(","):
                base = Path(f"/sys/fs/cgroup/memory{path}")
                return base if base.is_dir() else None
    return None


def _v2_root() -> Path | None:
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return root
    return None


@contextmanager
def memory_cap(limit: int) -> Iterator[tuple[Path, Path] | None]:
    """A transient memory cgroup with `limit` bytes: (its cgroup.procs, its peak-usage file),
    or None where the test cannot make one (not root, no writable memory controller)."""
    if os.geteuid() != 0:
        yield None
        return
    name = f"hostpool-readme-{os.getpid()}"
    v2, v1 = _v2_root(), _own_v1_memory_dir()
    group: Path | None = None
    files: tuple[Path, Path] | None = None
    try:
        if v2 is not None:
            group = v2 / name
            group.mkdir()
            (group / "memory.max").write_text(str(limit))
            if (group / "memory.swap.max").exists():  # swap would hide going over
                (group / "memory.swap.max").write_text("0")
            files = (group / "cgroup.procs", group / "memory.peak")
        elif v1 is not None:
            group = v1 / name
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(limit))
            files = (group / "cgroup.procs", group / "memory.max_usage_in_bytes")
    except OSError:
        files = None
    try:
        yield files
    finally:
        if group is not None and group.exists():
            group.rmdir()


def run_example(path: Path, procs: Path | None) -> subprocess.CompletedProcess[str]:
    """Run the example file with RUNNER; inside the cgroup when `procs` is given (the shell
    joins it, then execs the interpreter, so every byte the example maps is charged)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOSTPOOL", "PYTHONWARN"))}
    command = [sys.executable, "-c", RUNNER, str(path)]
    if procs is not None:
        command = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *command]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env, cwd=path.parent
    )


def test_the_example_is_the_library_section_and_modest() -> None:
    code = example()
    readme = PAGE.read_text()
    assert readme.index(MARKER) > readme.index("# hostpool as a library\n")
    assert "with HostPoolManager(" in code and "manager.close()" in code
    compile(code, str(PAGE), "exec")  # a syntax error is a failure here, not a skip


def test_the_example_runs_as_written_in_4_gib_and_ends_clean(tmp_path: Path) -> None:
    path = tmp_path / "readme_example.py"
    path.write_text(example())
    with memory_cap(CAP) as cap:
        proc = run_example(path, cap[0] if cap else None)
        peak = int(cap[1].read_text()) if cap and cap[1].exists() else None
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr == "", proc.stderr[-3000:]  # no warning, no leak event, nothing
    out = proc.stdout.splitlines()
    assert "LEFT fds 0 maps 0" in out, out
    assert out[out.index("LEFT fds 0 maps 0") - 1] == "no leaks", out

    # what the example holds at its peak, from its own snapshot lines: "<pool> <name> N MiB"
    sizes = [int(m.group(1)) << 20 for m in map(re.compile(r" (\d+) MiB live$").search, out) if m]
    assert sizes, out
    assert sum(sizes) <= CAP - HEADROOM, sizes
    assert any(line.startswith("kv ") and "hostpool.kv." in line for line in out), out

    if cap is not None:
        cgroup = next(line for line in out if line.startswith("CGROUP"))
        assert f"hostpool-readme-{os.getpid()}" in cgroup, cgroup  # it ran capped
        if peak is not None:
            assert sum(sizes) <= peak <= CAP, (peak, sizes)  # its pages were charged there
