"""Page states for the populate benchmark.

On a VM the history of a page decides its first-touch cost, so the benchmark sets it on
purpose: a 2 MiB hugetlb pool reserved for the run (and given back), pre-warming
(`--pages warm`), and waiting for the kernel's free page reporting to go quiet (`--pages
cold`). No torch import.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from pathlib import Path
from typing import Any

from bench._common import KiB, MiB, meminfo, read_text

MADV_POPULATE_WRITE = 23
HUGEPAGE_2MB = 2 * MiB
HUGEPAGE_SLACK = 64  # pages beyond the largest size: the pool may hold a page or two
PREWARM_MARGIN = 64 * MiB
PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")
REPORTING_QUIET_BYTES = 64 * MiB  # a reporting pass under this counts as quiet
REPORTING_QUIET_PASSES = 2  # ... this many passes in a row
REPORTING_TIMEOUT_S = 120.0


def prewarm(n: int) -> float:
    """Fault n bytes of anonymous memory in and free them again (untimed).

    On this VM a guest page the host has not backed yet (never touched, or handed back by
    free page reporting seconds after it was freed) costs ~8x more to fault than one it
    has; which kind a child gets depends on what ran before it. Faulting and freeing
    just before timing hands every variant host-backed pages from the free lists, so the
    timings compare what the allocators do, not the page history.
    """
    t0 = time.perf_counter()
    mm = mmap.mmap(-1, n + PREWARM_MARGIN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(MADV_POPULATE_WRITE)
    mm.close()
    return time.perf_counter() - t0


def hugepage_count_path() -> str:
    """/proc/sys/vm/nr_hugepages when 2 MiB is the default hugepage size, else sysfs."""
    if meminfo().get("Hugepagesize") == HUGEPAGE_2MB:
        return "/proc/sys/vm/nr_hugepages"
    return "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"


def hugepages_free_2mb() -> int:
    base = "/sys/kernel/mm/hugepages/hugepages-2048kB"
    free = int(read_text(f"{base}/free_hugepages") or 0)
    reserved = int(read_text(f"{base}/resv_hugepages") or 0)
    return free - reserved


class HugepageReservation:
    """Reserve enough 2 MiB pages for the whole run; always give the old count back."""

    def __init__(self, largest: int) -> None:
        self.path = hugepage_count_path()
        self.needed = -(-largest // HUGEPAGE_2MB)
        self.old: int | None = None
        self.written: int | None = None
        self.facts: dict[str, Any] = {"path": self.path, "needed_pages": self.needed}

    def _write(self, count: int) -> int:
        with open(self.path, "w") as f:
            f.write(f"{count}\n")
        self.written = int(read_text(self.path) or 0)
        return self.written

    def reserve(self) -> str | None:
        """None when reserved, else why not (the hugepage variants are then skipped)."""
        text = read_text(self.path)
        if text is None:
            return f"{self.path} is not readable: this kernel has no 2 MiB hugetlb pool"
        self.old = int(text)
        self.facts["old_pages"] = self.old
        free = hugepages_free_2mb()
        in_use = self.old - free
        want = max(self.old, in_use + self.needed + HUGEPAGE_SLACK)
        self.facts["requested_pages"] = want
        try:
            got = self._write(want) if want != self.old else self.old
        except OSError as exc:
            self.old = None  # nothing changed: nothing to restore
            return f"cannot write {self.path} ({exc.strerror}); run as root to reserve"
        self.facts["reserved_pages"] = got
        self.facts["free_pages"] = hugepages_free_2mb()
        if self.facts["free_pages"] < self.needed:
            return (
                f"asked for {want} pages of 2 MiB, the kernel reserved {got} "
                f"({self.facts['free_pages']} free, {self.needed} needed): memory is too "
                "fragmented or short"
            )
        return None

    def warm(self) -> float:
        """Fault in every free page of the pool once and give it back (seconds taken).

        Freshly reserved hugepages are not backed by the host yet (~0.1 GiB/s the first
        time, 8 GiB/s after); the pool hands pages out last-freed first, so a run that
        warmed only its largest size would leave the rest cold for whoever comes next."""
        pages = hugepages_free_2mb()
        if pages <= 0:
            return 0.0
        t0 = time.perf_counter()
        fd = os.memfd_create("bench_warm", os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_HUGE_2MB)
        try:
            os.ftruncate(fd, pages * HUGEPAGE_2MB)
            mm = mmap.mmap(fd, pages * HUGEPAGE_2MB, flags=mmap.MAP_SHARED)
            try:
                mm.madvise(MADV_POPULATE_WRITE)
            finally:
                mm.close()
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def top_up(self) -> None:
        """Others (tests run alongside) may shrink the pool between our runs: re-assert it."""
        if self.old is None or hugepages_free_2mb() >= self.needed:
            return
        current = int(read_text(self.path) or 0)
        with contextlib.suppress(OSError):
            got = self._write(current + self.needed - hugepages_free_2mb() + HUGEPAGE_SLACK)
            self.facts.setdefault("top_ups", []).append(
                {"from": current, "to": got, "warm_s": self.warm()}
            )

    def restore(self) -> None:
        """Put the old count back, unless someone else has set another since our write
        (then theirs stands: overwriting it could pull pages from under their test)."""
        if self.old is None:
            return
        current = int(read_text(self.path) or 0)
        if self.written is not None and current != self.written:
            self.facts["restore_skipped"] = f"count is {current}, set by someone else since"
        else:
            try:
                self.facts["restored_pages"] = self._write(self.old)
            except OSError as exc:
                self.facts["restore_error"] = str(exc)
        self.old = None


class FreePageReporting:
    """Progress of the kernel's free page reporting (virtio-balloon hands free memory back
    to the host), where the kernel shows it: `reported_kib` and `passes` under
    /sys/module/page_reporting/parameters. Mainline kernels show neither; bare metal has
    no reporting at all, and there `cold` is the same as `natural`."""

    IDLE_S = 10.0  # no pass for this long: nothing is left to report

    def __init__(self, root: Path = PAGE_REPORTING) -> None:
        self.root = root

    def counters(self) -> tuple[int, int] | None:
        """(bytes reported so far, passes so far), or None where the kernel hides them."""
        kib = read_text(str(self.root / "reported_kib"))
        passes = read_text(str(self.root / "passes"))
        if kib is None or passes is None:
            return None
        return int(kib) * KiB, int(passes)

    def wait_quiet(self) -> dict[str, Any]:
        """Block until REPORTING_QUIET_PASSES passes in a row report under
        REPORTING_QUIET_BYTES each (or no pass comes for IDLE_S); what it took."""
        first = self.counters()
        if first is None:
            raise RuntimeError(f"{self.root} shows no reported_kib/passes")
        t0 = last_change = time.monotonic()
        last_bytes, last_passes = first
        quiet = 0
        outcome = "quiet"
        while quiet < REPORTING_QUIET_PASSES:
            now = time.monotonic()
            if now - t0 > REPORTING_TIMEOUT_S:
                outcome = "timed_out"
                break
            if now - last_change > self.IDLE_S:
                outcome = "idle"
                break
            time.sleep(0.2)
            reported, passes = self.counters() or (last_bytes, last_passes)
            if passes == last_passes:
                continue
            quiet = quiet + 1 if reported - last_bytes < REPORTING_QUIET_BYTES else 0
            last_bytes, last_passes, last_change = reported, passes, time.monotonic()
        return {
            "outcome": outcome,
            "waited_s": time.monotonic() - t0,
            "reported_bytes": last_bytes - first[0],
            "passes": last_passes - first[1],
        }
