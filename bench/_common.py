"""Helpers shared by the benchmarks: sizes, machine facts, residency checks, result files.

Imports nothing heavy (no torch), so `bench/report.py` can use it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)

_libc = ctypes.CDLL(None, use_errno=True)  # libc is in the process already
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_size(text: str) -> int:
    """'1GiB', '4G', '64MiB', '512m', '1048576' -> bytes (binary units)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (use e.g. 64MiB, 1GiB, 4G or bytes)")
    number, unit = match.groups()
    value = float(number) * _UNITS[unit.lower()]
    if value <= 0 or value != int(value):
        raise ValueError(f"size must be a positive whole number of bytes: {text!r}")
    return int(value)


def format_size(nbytes: int) -> str:
    """Bytes -> '4 GiB', '64 MiB', '1.5 GiB' (binary units)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes, read by the same code the budget uses."""
    from hostpool.memory.kernel import meminfo as read

    return read()


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def loadavg() -> list[float]:
    text = read_text("/proc/loadavg") or "0 0 0"
    return [float(x) for x in text.split()[:3]]


def _busy_cpu_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq


def _own_cpu_seconds(me: psutil.Process) -> float:
    """This process's CPU, its reaped children's, and its live descendants' (a server the
    bench started and measures is the bench's own work, not another process's)."""
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:
            continue  # gone meanwhile: counted by its parent once reaped
        total += c.user + c.system
    return total


class LoadMeter:
    """What the rest of the machine has done since the meter was made: every CPU's busy
    time less this process's and its descendants' (kernel workers count as others).

    The load average cannot tell this: it counts the benchmark's own children."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._busy, self._own = _busy_cpu_seconds(), _own_cpu_seconds(self._me)
        self._start = time.monotonic()

    def read(self) -> dict[str, float]:
        """{"wall_s": seconds since the start, "other_cpus": other processes' CPUs on
        average over them}."""
        wall = time.monotonic() - self._start
        other = (_busy_cpu_seconds() - self._busy) - (_own_cpu_seconds(self._me) - self._own)
        # tick-granular counters on both sides: a small negative difference is rounding
        return {"wall_s": wall, "other_cpus": max(0.0, other) / wall if wall > 0 else 0.0}


@contextlib.contextmanager
def other_cpu() -> Iterator[dict[str, float]]:
    """`LoadMeter` over the block: the dict it yields is filled when the block ends."""
    meter = LoadMeter()
    out: dict[str, float] = {}
    yield out
    out.update(meter.read())


# Other processes' CPU (average over a run's samples) above which its figures are not
# published as measured: the table says "measured under load" instead.
QUIET_OTHER_CPUS = 0.2


def other_cpus_of(data: Any) -> list[float]:
    """Every `other_cpus` a result records (per sample, per case, per round), in order."""
    found: list[float] = []
    if isinstance(data, dict):
        for key, value in data.items():
            if key == "other_cpus" and isinstance(value, int | float):
                found.append(float(value))
            else:
                found += other_cpus_of(value)
    elif isinstance(data, list):
        for value in data:
            found += other_cpus_of(value)
    return found


def load_verdict(data: dict[str, Any]) -> str | None:
    """None for a quiet run; else one line saying why its figures are not clean: other
    processes used more than QUIET_OTHER_CPUS on average, or the run recorded nothing."""
    loads = other_cpus_of(data)
    if not loads:
        return "the load on the machine was not recorded for this run: rerun the bench"
    mean = sum(loads) / len(loads)
    if mean <= QUIET_OTHER_CPUS:
        return None
    return (
        f"measured under load: other processes used {mean:.2f} CPUs on average "
        f"(at most {QUIET_OTHER_CPUS} for a published figure); rerun on a quiet machine"
    )


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    text = read_text("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return None


def machine_facts() -> dict[str, Any]:
    """What a reader needs to judge the numbers; no torch import (versions from metadata)."""
    mem = meminfo()
    return {
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "mem_total_bytes": mem.get("MemTotal"),
        "mem_available_bytes": mem.get("MemAvailable"),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": package_version("torch"),
        "sglang": package_version("sglang"),
        "hostpool": package_version("hostpool"),
        "thp_enabled": read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "loadavg": loadavg(),
    }


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def madvise(address: int, length: int, advice: int) -> None:
    """libc madvise (the GIL is released for the call, unlike mmap.madvise); OSError on
    failure."""
    if _libc.madvise(address, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}): {os.strerror(err)}")


def resident_bytes(address: int, length: int) -> int:
    """Bytes of [address, address+length) resident now, by mincore (~5 ms for 4 GiB).

    The range is widened to whole base pages; each vector byte covers one base page, also
    for hugetlb mappings.
    """
    start = address - address % PAGE
    end = address + length
    pages = -(-(end - start) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(start, pages * PAGE, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    absent = bytes(vec).count(0)  # only bit 0 is defined; the rest are zero
    return min(length, (pages - absent) * PAGE)


class LogLines:
    """Reads a pipe on a thread, keeping every line."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # end of stream
            self.changed.notify_all()

    def wait_for(
        self, pattern: str, proc: subprocess.Popen[str], within: float = 600.0
    ) -> re.Match[str]:
        """The first line (from the start) matching `pattern`; RuntimeError once `proc`
        has exited without one, or after `within` seconds (an upper bound for a busy
        host, not a figure)."""
        deadline = time.monotonic() + within
        seen = 0
        with self.changed:
            while True:
                for line in self.lines[seen:]:
                    match = re.search(pattern, line)
                    if match is not None:
                        return match
                    if line == "":
                        said = "".join(self.lines[-5:])
                        raise RuntimeError(f"exited {proc.wait()} before {pattern!r}: {said}")
                seen = len(self.lines)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {pattern!r} within {within} s")
                self.changed.wait(1.0)

    def join(self) -> None:
        self._thread.join()


def start_serve(size: int) -> tuple[subprocess.Popen[str], LogLines]:
    """`hostpool serve --port 0 --pool kv=SIZE` from this checkout, and its log (stderr,
    JSON lines) read as it comes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostpool", "serve", "--port", "0", "--pool", f"kv={size}"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, LogLines(proc.stderr)


def too_big(size: int, headroom: int = 2 * GiB) -> str | None:
    """Why `size` bytes may not be populated now, or None when they may: MemAvailable must
    keep `headroom` bytes for the rest of the machine."""
    available = meminfo().get("MemAvailable", 0)
    if size + headroom <= available:
        return None
    return (
        f"MemAvailable {format_size(available)} < {format_size(size)} + "
        f"{format_size(headroom)} headroom"
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file), pretty and newline-terminated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_result(path: Path, **fields: Any) -> None:
    """A bench's result file: `fields`, then the date (UTC) and the machine's facts."""
    write_json(path, {**fields, "date": utc_now(), "machine": machine_facts()})


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
