"""Allocate-and-populate throughput: hostpool against the allocators servers run today.

For each size (default 1 GiB and 4 GiB) and each of `--runs` rounds, every variant runs in
a fresh process (`python bench/populate.py --one VARIANT --bytes N`, which prints one JSON
line), in a new random order each round (seeded), so drift, place and the neighbour
whose freed pages a child meets fall on all variants alike. In the child, set-up
(imports, allocator construction) and one small warm-up call of the variant (2 MiB: lazy
imports, probes, thread pools) are not timed; then only
allocate + populate (+ the tensor over it) is. Afterwards the child checks that every
byte is resident (`fstat().st_blocks` for fd-backed regions, `mincore` for all), so
nothing lazy passes for fast.

The sglang variants call the installed sglang package's own allocators
(`sglang.srt.mem_cache.storage.mmap.mmap_allocator`), configured through its environment
variables as a server would be; the version is recorded with the results.

Variants:
  hostpool_shm               ShmHostTensorAllocator(populate="auto"): memfd, sealed,
                             MADV_POPULATE_WRITE split over threads (libc, GIL released)
  hostpool_shm_2mb           the same with hugepages="required", hugepage_size="2MB"
  hostpool_mmap              MmapHostTensorAllocator(populate="auto"): private anonymous,
                             same populate
  sglang_alloc_shm           sglang's alloc_shm: memfd + mmap + one MADV_POPULATE_WRITE
  sglang_alloc_mmap          sglang's alloc_mmap, default: anonymous shared + madvise
  sglang_alloc_mmap_2mb      sglang's alloc_mmap with SGLANG_HUGEPAGE_SIZE=2MB: anonymous
                             MAP_HUGETLB|MAP_POPULATE (checked: no silent fallback)
  sglang_alloc_mmap_parallel sglang's alloc_mmap with SGLANG_HICACHE_HOST_PARALLEL_ALLOC_
                             THREADS = hostpool's populate threads: private anonymous,
                             MADV_HUGEPAGE, memset over threads
  seed_pr_memfd              the seed PR's allocator, restated (memfd + MAP_POPULATE + a
                             second MADV_POPULATE_WRITE walk); sglang no longer does this
  vllm_devshm_madvise        vLLM-style, restated: a /dev/shm file (O_CREAT|O_EXCL,
                             unlinked), ftruncate, mmap shared, mm.madvise(POPULATE_WRITE)
  torch_empty_zero           torch.empty(n, dtype=torch.uint8).zero_()  (the baseline)
  bare_hugetlb_madvise       a 2 MiB hugetlb memfd and MADV_POPULATE_WRITE over the same
                             threads, nothing else: the kernel's own cost (it zeroes every
                             hugepage it hands out), so the most a 2 MiB allocator reaches
  bare_shm_populate          the same over a 4 KiB-page memfd
  bare_anon_populate         private anonymous mmap and MADV_POPULATE_WRITE over the same
                             threads, nothing else: the most a 4 KiB-page allocator reaches
The bare variants' threads take 64 MiB spans from one queue, the fastest split measured
here (one span per thread left hugetlb populate no faster than one thread).

hostpool_shm_2mb and bare_hugetlb_madvise do the same work (the same madvise over the same
threads and spans), so what tells them apart is smaller than the run-to-run noise. Each
round runs them as SAME_WORK_PAIRS adjacent pairs, each side first in exactly half of a
size's pairs (the first of a pair follows a random neighbour, the second its partner),
giving them four times the samples; the target is judged like every other (ratio of the
two medians), and each pair's own ratio is kept as well (`same_work_paired_ratios`).

Page states (`--pages`), since on a VM the history of a page decides its fault cost:
  warm     every child faults in and frees n bytes just before timing (host-backed pages)
  natural  no preparation: whatever the previous child left (order-dependent)
  cold     the parent waits until the kernel's free page reporting goes quiet, so memory
           freed by earlier children has gone back to the host, as idle memory does

2 MiB hugepages are reserved once for the whole run through /proc/sys/vm/nr_hugepages
(restored afterwards), then warmed by one discarded run: freshly reserved pages are cold.
Writes bench/results/populate.json; `bench/report.py` turns it into tables and a chart.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    RESULTS_DIR,
    GiB,
    MiB,
    format_size,
    machine_facts,
    madvise,
    meminfo,
    other_cpu,
    parse_size,
    resident_bytes,
    utc_now,
    write_json,
)
from bench._pages import (
    HUGEPAGE_2MB,
    MADV_POPULATE_WRITE,
    PAGE_REPORTING,
    REPORTING_QUIET_BYTES,
    REPORTING_QUIET_PASSES,
    FreePageReporting,
    HugepageReservation,
    hugepages_free_2mb,
    prewarm,
)

RESULTS = RESULTS_DIR / "populate.json"
CHILD_TIMEOUT_S = 600.0
BASELINE = "torch_empty_zero"
WARMUP_BYTES = 2 * MiB  # the untimed first call of every variant
THREADS = min(8, os.cpu_count() or 1)  # hostpool's default populate threads; sglang's too
BARE_SPAN = 64 << 20  # a multiple of every page size used here
ORDER_SEED = 20261204
# hostpool's 2 MiB allocator and the bare call make the same madvise over the same threads
# and spans: their difference is smaller than run-to-run noise, so each round runs them as
# this many adjacent pairs, not once each.
SAME_WORK = ("hostpool_shm_2mb", "bare_hugetlb_madvise")
SAME_WORK_PAIRS = 4  # even: each side goes first equally often in every round set
SGLANG_MODULE = "sglang.srt.mem_cache.storage.mmap.mmap_allocator"

VARIANTS: dict[str, str] = {
    "hostpool_shm": 'hostpool ShmHostTensorAllocator(populate="auto", hugepages="off")',
    "hostpool_shm_2mb": (
        'hostpool ShmHostTensorAllocator(populate="auto", hugepages="required", '
        'hugepage_size="2MB")'
    ),
    "hostpool_mmap": 'hostpool MmapHostTensorAllocator(populate="auto")',
    "sglang_alloc_shm": "sglang alloc_shm: memfd_create + mmap(MAP_SHARED) + one "
    "MADV_POPULATE_WRITE + torch.frombuffer",
    "sglang_alloc_mmap": "sglang alloc_mmap (default): anonymous MAP_SHARED + one "
    "MADV_POPULATE_WRITE + torch.frombuffer",
    "sglang_alloc_mmap_2mb": "sglang alloc_mmap, SGLANG_HUGEPAGE_SIZE=2MB: anonymous "
    "MAP_SHARED|MAP_HUGETLB|MAP_HUGE_2MB|MAP_POPULATE",
    "sglang_alloc_mmap_parallel": "sglang alloc_mmap, "
    f"SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS={THREADS}: private anonymous, "
    "MADV_DONTFORK + MADV_HUGEPAGE, memset over threads",
    "seed_pr_memfd": "the seed PR's allocator, restated: memfd_create(MFD_CLOEXEC) + "
    "ftruncate + mmap(MAP_SHARED|MAP_POPULATE) + mm.madvise(MADV_POPULATE_WRITE)",
    "vllm_devshm_madvise": "vLLM-style, restated: /dev/shm file (O_CREAT|O_EXCL, unlinked) "
    "+ ftruncate + mmap(MAP_SHARED) + mm.madvise(MADV_POPULATE_WRITE) + torch.frombuffer",
    "torch_empty_zero": "torch.empty(n, dtype=torch.uint8).zero_()",
    "bare_hugetlb_madvise": (
        "memfd_create(MFD_HUGETLB|MFD_HUGE_2MB) + ftruncate + mmap(MAP_SHARED) + libc "
        f"madvise(MADV_POPULATE_WRITE) over {THREADS} threads + torch.frombuffer: the "
        "kernel's floor for 2 MiB pages"
    ),
    "bare_shm_populate": (
        "memfd_create + ftruncate + mmap(MAP_SHARED) + libc madvise(MADV_POPULATE_WRITE) "
        f"over {THREADS} threads + torch.frombuffer: the kernel's floor for shared "
        "4 KiB pages"
    ),
    "bare_anon_populate": (
        "mmap(MAP_PRIVATE|MAP_ANONYMOUS) + libc madvise(MADV_POPULATE_WRITE) over "
        f"{THREADS} threads + torch.frombuffer: the kernel's floor for 4 KiB pages"
    ),
}
HUGEPAGE_VARIANTS = frozenset({"hostpool_shm_2mb", "bare_hugetlb_madvise", "sglang_alloc_mmap_2mb"})
SGLANG_VARIANTS = frozenset(v for v in VARIANTS if v.startswith("sglang_"))
SGLANG_ENV = {
    "sglang_alloc_mmap_2mb": {"SGLANG_HUGEPAGE_SIZE": "2MB"},
    "sglang_alloc_mmap_parallel": {"SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS": str(THREADS)},
}
PAGES_HELP = {
    "warm": "each child faults in and frees n bytes of anonymous memory (untimed) just "
    "before timing, so every variant gets host-backed pages from the free lists",
    "natural": "no pre-fault: pages are as the previous child and free page reporting "
    "left them (on this VM unbacked pages fault ~8x slower; order-dependent)",
    "cold": "before each child the parent waits until the kernel's free page reporting "
    f"goes quiet ({REPORTING_QUIET_PASSES} passes in a row under "
    f"{format_size(REPORTING_QUIET_BYTES)}), so pages freed by earlier children are back "
    "with the host, as idle memory is when a server starts; the kernel keeps a remainder "
    "unreported and hands it out first, and the reserved hugetlb pool is never reported",
}


@dataclass(frozen=True)
class Target:
    """`variant` must be at least `min_ratio` times as fast as `versus` (same run's medians).

    `ceiling`, where set, is the variant that does only the kernel's share of the work:
    its ratio to `versus` in the same run is the most any allocator of that kind could
    reach, and `why` says what bounds it."""

    id: str
    kind: str  # "required" or "aim"
    variant: str
    versus: str
    min_ratio: float
    size_bytes: int | None  # None: at every measured size
    text: str
    ceiling: str | None = None
    why: str = ""


HUGEPAGE_WHY = (
    "the kernel zeroes every hugepage it hands out, one pass of memory writes; spreading "
    "it over threads, as the ceiling does, is all an allocator can add"
)
SHM_WHY = (
    "sglang faults the pages in on one thread; the only thing left to gain is spreading "
    "the same faults over threads, at most one per CPU, and shared-memory faults contend "
    "on the file's page cache"
)
ANON_WHY = (
    "faulting a 4 KiB page in (kernel zeroing included) is the work; on this VM its "
    "cost is set by whether the host still backs the page, the same for every allocator"
)
TARGETS = (
    Target(
        "shm_vs_sglang_shm",
        "required",
        "hostpool_shm",
        "sglang_alloc_shm",
        1.5,
        None,
        "hostpool shm >= 1.5x sglang alloc_shm",
        ceiling="bare_shm_populate",
        why=SHM_WHY,
    ),
    Target(
        "hugepages_vs_sglang_hugetlb",
        "required",
        "hostpool_shm_2mb",
        "sglang_alloc_mmap_2mb",
        1.0,
        None,
        "hostpool shm with 2 MiB hugepages >= 1.0x sglang alloc_mmap (2 MiB hugetlb)",
        ceiling="bare_hugetlb_madvise",
        why=HUGEPAGE_WHY,
    ),
    Target(
        "hugepages_vs_bare_kernel",
        "required",
        "hostpool_shm_2mb",
        "bare_hugetlb_madvise",
        0.9,
        None,
        "hostpool shm with 2 MiB hugepages >= 0.9x the bare kernel call",
    ),
    Target(
        "mmap_vs_torch",
        "required",
        "hostpool_mmap",
        BASELINE,
        1.0,
        None,
        "hostpool mmap >= 1.0x torch.empty().zero_()",
        ceiling="bare_anon_populate",
        why=ANON_WHY,
    ),
    Target(
        "mmap_vs_sglang_parallel",
        "required",
        "hostpool_mmap",
        "sglang_alloc_mmap_parallel",
        1.5,
        None,
        "hostpool mmap >= 1.5x sglang alloc_mmap (parallel private THP)",
        ceiling="bare_anon_populate",
        why=ANON_WHY,
    ),
    Target(
        "shm_vs_torch",
        "aim",
        "hostpool_shm",
        BASELINE,
        0.8,
        None,
        "hostpool shm >= 0.8x torch.empty().zero_() (aim)",
    ),
    Target(
        "hugepages_vs_torch",
        "required",
        "hostpool_shm_2mb",
        BASELINE,
        4.0,
        None,
        "hostpool shm with 2 MiB hugepages >= 4x torch.empty().zero_()",
        ceiling="bare_hugetlb_madvise",
        why=HUGEPAGE_WHY,
    ),
)


# ---------------------------------------------------------------------------------------
# Child: one variant, one size, one fresh process.
# ---------------------------------------------------------------------------------------
@dataclass
class Made:
    """What a variant built: the tensor, how to check residency, how to tear it down."""

    tensor: Any
    address: int
    fd: int | None
    teardown: Callable[[], None]
    details: dict[str, Any] = field(default_factory=dict)


def _frombuffer(mm: mmap.mmap, n: int) -> Any:
    import torch

    return torch.frombuffer(mm, dtype=torch.uint8, count=n)


def _close_mapping(holder: dict[str, Any], fd: int | None) -> Callable[[], None]:
    def teardown() -> None:
        holder.pop("tensor", None)
        mm = holder.pop("mm", None)
        if mm is not None:
            mm.close()
        if fd is not None:
            os.close(fd)

    return teardown


def _mapping_address(mm: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(view)
    del view  # an export would keep mm.close() from unmapping
    return address


def _anon_huge_bytes() -> int:
    """AnonHugePages of this process (THP it holds), from /proc/self/smaps_rollup."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def make_seed_pr(n: int) -> Made:
    fd = os.memfd_create(f"bench_seed_{os.getpid()}", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    mm.madvise(MADV_POPULATE_WRITE)
    tensor = _frombuffer(mm, n)
    holder = {"mm": mm}
    return Made(tensor, tensor.data_ptr(), fd, _close_mapping(holder, fd))


def make_vllm(n: int) -> Made:
    path = f"/dev/shm/bench_vllm_{os.getpid()}_{secrets.token_hex(4)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.unlink(path)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
    mm.madvise(MADV_POPULATE_WRITE)
    tensor = _frombuffer(mm, n)
    holder = {"mm": mm}
    return Made(tensor, tensor.data_ptr(), fd, _close_mapping(holder, fd))


def make_bare_hugetlb(n: int) -> Made:
    fd = os.memfd_create(
        f"bench_hugetlb_{os.getpid()}", os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_HUGE_2MB
    )
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
    try:
        _populate_threads(mm, n)
    except OSError:
        mm.close()
        os.close(fd)
        raise
    tensor = _frombuffer(mm, n)
    holder = {"mm": mm}
    return Made(tensor, tensor.data_ptr(), fd, _close_mapping(holder, fd))


def _populate_threads(mm: mmap.mmap, n: int) -> None:
    """MADV_POPULATE_WRITE over n bytes in BARE_SPAN pieces that THREADS threads take from
    one queue (libc: GIL released)."""
    address = _mapping_address(mm)
    spans = [(off, min(BARE_SPAN, n - off)) for off in range(0, n, BARE_SPAN)]
    with ThreadPoolExecutor(min(THREADS, len(spans))) as pool:
        list(pool.map(lambda s: madvise(address + s[0], s[1], MADV_POPULATE_WRITE), spans))


def make_bare_anon(n: int) -> Made:
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _populate_threads(mm, n)
    tensor = _frombuffer(mm, n)
    holder = {"mm": mm}
    return Made(tensor, tensor.data_ptr(), None, _close_mapping(holder, None))


def make_bare_shm(n: int) -> Made:
    fd = os.memfd_create(f"bench_shm_{os.getpid()}", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
    _populate_threads(mm, n)
    tensor = _frombuffer(mm, n)
    holder = {"mm": mm}
    return Made(tensor, tensor.data_ptr(), fd, _close_mapping(holder, fd))


def make_torch(n: int) -> Made:
    import torch

    tensor = torch.empty(n, dtype=torch.uint8).zero_()
    return Made(tensor, tensor.data_ptr(), None, lambda: None)


def make_hostpool(n: int) -> Made:
    import torch

    alloc = _PREPARED["allocator"]()  # one per call: teardown closes it
    tensor = alloc.allocate((n,), torch.uint8)
    region = alloc.regions[-1]
    facts = region.facts
    # Teardown runs after the tensor is dropped (that unmaps it); close() must not keep
    # a reference to the tensor, or the unmap would wait for the closure.
    details = {
        "backend": facts.backend,
        "page_size": facts.page_size,
        "mapped_bytes": facts.mapped_bytes,
        "populate_mode": facts.populate_mode,
        "populate_seconds": facts.populate_seconds,
        "populate_threads": alloc.options.effective_populate_threads(),
        "hugepage_fallbacks": list(facts.hugepage_fallbacks),
        "thp_advised": facts.thp_advised,
        "seals": facts.seals,
    }
    return Made(tensor, tensor.data_ptr(), region.fd, alloc.close, details)


def make_sglang_shm(n: int) -> Made:
    import torch

    tensor, fd, mm = _PREPARED["sglang"].alloc_shm((n,), torch.uint8)
    holder = {"mm": mm}
    return Made(tensor, tensor.data_ptr(), fd, _close_mapping(holder, fd))


def make_sglang_mmap(n: int) -> Made:
    """alloc_mmap as the environment configures it; the tensor owns the mapping."""
    import torch

    free_before = hugepages_free_2mb()
    tensor = _PREPARED["sglang"].alloc_mmap((n,), torch.uint8)
    details: dict[str, Any] = {"anon_huge_bytes": _anon_huge_bytes()}
    if os.environ.get("SGLANG_HUGEPAGE_SIZE"):
        taken = free_before - hugepages_free_2mb()
        details["hugepages_taken"] = taken
        if taken * HUGEPAGE_2MB < n:
            # sglang logs and falls back to plain mmap: never time that as hugetlb
            raise RuntimeError(f"sglang hugetlb alloc_mmap fell back ({taken} pages taken)")
    return Made(tensor, tensor.data_ptr(), None, lambda: None, details)


# Untimed set-up for a variant: imports, allocator construction.
_PREPARED: dict[str, Any] = {}


def _prepare_hostpool(cls: str, **options: Any) -> Callable[[], None]:
    def prepare() -> None:
        import hostpool

        allocator_class = getattr(hostpool, cls)
        _PREPARED["allocator"] = lambda: allocator_class(pool="bench", **options)

    return prepare


def _prepare_torch() -> None:
    import torch

    torch.empty(1, dtype=torch.uint8).zero_()  # load the library, not allocate for it


def _prepare_sglang(variant: str) -> Callable[[], None]:
    def prepare() -> None:
        import importlib

        os.environ.update(SGLANG_ENV.get(variant, {}))  # read by sglang at each call
        _PREPARED["sglang"] = importlib.import_module(SGLANG_MODULE)

    return prepare


HOSTPOOL_SHM = {"populate": "auto", "hugepages": "off"}
HOSTPOOL_SHM_2MB = {"populate": "auto", "hugepages": "required", "hugepage_size": "2MB"}
MAKERS: dict[str, tuple[Callable[[], None], Callable[[int], Made]]] = {
    "hostpool_shm": (_prepare_hostpool("ShmHostTensorAllocator", **HOSTPOOL_SHM), make_hostpool),
    "hostpool_shm_2mb": (
        _prepare_hostpool("ShmHostTensorAllocator", **HOSTPOOL_SHM_2MB),
        make_hostpool,
    ),
    "hostpool_mmap": (
        _prepare_hostpool("MmapHostTensorAllocator", populate="auto"),
        make_hostpool,
    ),
    "sglang_alloc_shm": (_prepare_sglang("sglang_alloc_shm"), make_sglang_shm),
    "sglang_alloc_mmap": (_prepare_sglang("sglang_alloc_mmap"), make_sglang_mmap),
    "sglang_alloc_mmap_2mb": (_prepare_sglang("sglang_alloc_mmap_2mb"), make_sglang_mmap),
    "sglang_alloc_mmap_parallel": (
        _prepare_sglang("sglang_alloc_mmap_parallel"),
        make_sglang_mmap,
    ),
    "seed_pr_memfd": (_prepare_torch, make_seed_pr),
    "vllm_devshm_madvise": (_prepare_torch, make_vllm),
    "torch_empty_zero": (_prepare_torch, make_torch),
    "bare_hugetlb_madvise": (_prepare_torch, make_bare_hugetlb),
    "bare_shm_populate": (_prepare_torch, make_bare_shm),
    "bare_anon_populate": (_prepare_torch, make_bare_anon),
}


def _drop(made: Made) -> float:
    t0 = time.perf_counter()
    del made.tensor
    made.teardown()
    return time.perf_counter() - t0


def run_one(variant: str, n: int, pages: str) -> dict[str, Any]:
    prepare, make = MAKERS[variant]
    prepare()
    t_warm = time.perf_counter()
    _drop(make(WARMUP_BYTES))  # lazy imports, probes, thread pools: not what is compared
    warmup_seconds = time.perf_counter() - t_warm
    prewarm_seconds = prewarm(n) if pages == "warm" else None
    t0 = time.perf_counter()
    made = make(n)
    seconds = time.perf_counter() - t0

    # Not timed: prove every byte is there.
    checks: dict[str, int] = {"mincore": resident_bytes(made.address, n)}
    if made.fd is not None:
        checks["st_blocks"] = os.fstat(made.fd).st_blocks * 512
    resident = min(checks.values())
    if resident < n:
        raise RuntimeError(f"{variant}: only {resident} of {n} bytes resident after populate")

    teardown_seconds = _drop(made)
    return {
        "variant": variant,
        "bytes": n,
        "seconds": seconds,
        "resident_bytes": resident,
        "residency_checks": checks,
        "teardown_seconds": teardown_seconds,
        "warmup_seconds": warmup_seconds,
        "pages": pages,
        "prewarm_seconds": prewarm_seconds,
        "details": made.details,
    }


# ---------------------------------------------------------------------------------------
# Parent: hugepage reservation, interleaved fresh-process runs, statistics, targets.
# ---------------------------------------------------------------------------------------
def spawn(variant: str, n: int, pages: str) -> dict[str, Any]:
    """Run one sample in a fresh interpreter; never raises for the child's failures."""
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, script, "--one", variant, "--bytes", str(n), "--pages", pages]
    try:
        with other_cpu() as others:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
            )
    except subprocess.TimeoutExpired:
        return {"variant": variant, "bytes": n, "error": f"timed out after {CHILD_TIMEOUT_S} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {
            "variant": variant,
            "bytes": n,
            "error": f"exit {proc.returncode}: " + " | ".join(tail),
        }
    sample: dict[str, Any] = json.loads(lines[-1])
    sample["other_cpus"] = others["other_cpus"]
    return sample


def gib_per_s(n: int, seconds: float | None) -> float | None:
    return n / GiB / seconds if seconds else None


def summarise(
    sizes: list[int], variants: list[str], samples: list[dict[str, Any]], skipped: dict[str, str]
) -> list[dict[str, Any]]:
    out = []
    for n in sizes:
        by_variant: dict[str, dict[str, Any]] = {}
        base = {s["run"]: s["seconds"] for s in samples if _ok(s, BASELINE, n)}
        base_median = statistics.median(base.values()) if base else None
        for variant in variants:
            if variant in skipped:
                by_variant[variant] = {"status": "skipped", "reason": skipped[variant]}
                continue
            mine = [s for s in samples if s["variant"] == variant and s["bytes"] == n]
            good = [s for s in mine if "error" not in s]
            errors = [s["error"] for s in mine if "error" in s]
            if not good:
                by_variant[variant] = {
                    "status": "error" if errors else "not_run",
                    "errors": errors,
                }
                continue
            seconds = [s["seconds"] for s in good]
            median = statistics.median(seconds)
            paired = [base[s["run"]] / s["seconds"] for s in good if s["run"] in base]
            by_variant[variant] = {
                "status": "ok",
                "samples_s": seconds,
                "median_s": median,
                "min_s": min(seconds),
                "max_s": max(seconds),
                "gib_per_s": gib_per_s(n, median),
                "ratio_to_torch": base_median / median if base_median else None,
                "paired_ratio_to_torch_median": statistics.median(paired) if paired else None,
                "teardown_median_s": statistics.median(s["teardown_seconds"] for s in good),
                "errors": errors,
            }
        row: dict[str, Any] = {"size_bytes": n, "size": format_size(n), "variants": by_variant}
        pairs = paired_ratios(samples, n)
        if pairs:
            row["same_work_paired_ratios"] = pairs
        out.append(row)
    return out


def first_of_pairs(rng: random.Random, runs: int) -> list[list[str]]:
    """For each round, which SAME_WORK variant goes first in each of its pairs: each side
    first in exactly half of all pairs of a size (shuffled). The first of a pair follows
    whatever variant ran before, whose teardown can leave the kernel busy; the second
    follows its partner. In the last run before this balance, the second of a pair ran up
    to 20% faster, and a random draw had put hostpool first in 12 of 15 pairs."""
    total = runs * SAME_WORK_PAIRS
    firsts = [SAME_WORK[i % 2] for i in range(total)]
    rng.shuffle(firsts)
    return [firsts[r * SAME_WORK_PAIRS : (r + 1) * SAME_WORK_PAIRS] for r in range(runs)]


def round_order(
    rng: random.Random, active: list[str], firsts: list[str]
) -> list[tuple[str, int | None]]:
    """One round's children as (variant, pair): every variant once, in random order, except
    that when both SAME_WORK variants run they come as adjacent pairs, `firsts[i]` first in
    pair i, each pair placed at random like any other variant."""
    if not set(SAME_WORK) <= set(active):
        return [(v, None) for v in rng.sample(active, len(active))]
    units: list[list[tuple[str, int | None]]] = [[(v, None)] for v in active if v not in SAME_WORK]
    for pair, first in enumerate(firsts):
        second = SAME_WORK[1] if first == SAME_WORK[0] else SAME_WORK[0]
        units.append([(first, pair), (second, pair)])
    rng.shuffle(units)
    return [child for unit in units for child in unit]


def paired_ratios(samples: list[dict[str, Any]], n: int) -> list[float]:
    """bare seconds / hostpool seconds for each adjacent SAME_WORK pair of size n that both
    ran: per-pair ratios cancel the drift that moves both sides of a pair alike."""
    seconds: dict[tuple[int, int], dict[str, float]] = {}
    for s in samples:
        if s.get("pair") is not None and s["bytes"] == n and "error" not in s:
            seconds.setdefault((s["run"], s["pair"]), {})[s["variant"]] = s["seconds"]
    mine, bare = SAME_WORK
    return [p[bare] / p[mine] for _, p in sorted(seconds.items()) if mine in p and bare in p]


def _ok(sample: dict[str, Any], variant: str, n: int) -> bool:
    return sample["variant"] == variant and sample["bytes"] == n and "error" not in sample


def evaluate(target: Target, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Pass/fail from the measured medians; None when the data needed is missing."""
    rows = [r for r in results if target.size_bytes in (None, r["size_bytes"])]
    checks = []
    missing = []
    for row in rows:
        mine = row["variants"].get(target.variant, {})
        other = row["variants"].get(target.versus, {})
        gaps = [
            f"{name} {r.get('reason') or r.get('status') or 'not run'}"
            for name, r in ((target.variant, mine), (target.versus, other))
            if r.get("status") != "ok"
        ]
        if gaps:
            missing.append(f"{row['size']}: " + ", ".join(gaps))
            continue
        ratio = other["median_s"] / mine["median_s"]
        check: dict[str, Any] = {
            "size_bytes": row["size_bytes"],
            "ratio": ratio,
            "ok": ratio >= target.min_ratio,
        }
        top = row["variants"].get(target.ceiling or "", {})
        if top.get("status") == "ok":
            # the most any allocator of this kind reached against `versus`, same run
            check["ceiling_ratio"] = other["median_s"] / top["median_s"]
        checks.append(check)
    if not rows:
        passed: bool | None = None
        missing.append(f"{format_size(target.size_bytes or 0)} not measured in this run")
    elif missing:
        passed = False if any(not c["ok"] for c in checks) else None
    else:
        passed = all(c["ok"] for c in checks)
    return {
        "id": target.id,
        "kind": target.kind,
        "text": target.text,
        "variant": target.variant,
        "versus": target.versus,
        "min_ratio": target.min_ratio,
        "size_bytes": target.size_bytes,
        "ceiling": target.ceiling,
        "why": target.why,
        "checks": checks,
        "missing": missing,
        "pass": passed,
    }


def print_table(data: dict[str, Any]) -> None:
    print(
        f"\npopulate: {data['machine']['kernel']}, {data['machine']['cpus']} cpus, "
        f"{data['config']['runs']} run(s) per variant, fresh process each"
    )
    for row in data["results"]:
        print(f"\n{row['size']}")
        print(f"  {'variant':<27} {'median s':>9} {'GiB/s':>7} {'x torch':>8}  samples (s)")
        for variant, r in row["variants"].items():
            if r["status"] != "ok":
                reason = r.get("reason") or "; ".join(r.get("errors", [])) or r["status"]
                print(f"  {variant:<27} {r['status']}: {reason}")
                continue
            ratio = r["ratio_to_torch"]
            samples = ", ".join(f"{s:.3f}" for s in r["samples_s"])
            print(
                f"  {variant:<27} {r['median_s']:>9.3f} {r['gib_per_s']:>7.2f} "
                f"{(f'{ratio:.2f}x' if ratio else '-'):>8}  {samples}"
            )
    print("\ntargets")
    for t in data["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        ratios = ", ".join(
            f"{format_size(c['size_bytes'])}: {c['ratio']:.2f}x" for c in t["checks"]
        )
        extra = "; ".join(t["missing"])
        print(f"  [{verdict}] {t['text']}: " + "; ".join(filter(None, [ratios, extra])))


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the hugepage count is always restored."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_all(
    sizes: list[int], runs: int, variants: list[str], quick: bool, pages: str
) -> dict[str, Any]:
    started = utc_now()
    machine = machine_facts()
    samples: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    hugepages: dict[str, Any] = {"status": "not_requested"}
    reservation: HugepageReservation | None = None
    wanted_huge = [v for v in variants if v in HUGEPAGE_VARIANTS]

    with terminate_cleanly():
        try:
            if wanted_huge:
                reservation = HugepageReservation(max(sizes))
                reason = reservation.reserve()
                hugepages = reservation.facts
                if reason is not None:
                    hugepages["status"] = "skipped"
                    hugepages["reason"] = reason
                    skipped.update(dict.fromkeys(wanted_huge, reason))
                    print(f"hugepages: skipped: {reason}", file=sys.stderr)
                else:
                    hugepages["status"] = "reserved"
                    print(
                        f"hugepages: {hugepages['reserved_pages']} x 2 MiB reserved "
                        f"(was {hugepages['old_pages']}); warming up",
                        file=sys.stderr,
                    )
                    hugepages["warm_s"] = reservation.warm()

            active = [v for v in variants if v not in skipped]
            rng = random.Random(ORDER_SEED)
            firsts = {n: first_of_pairs(rng, runs) for n in sizes}
            for run in range(runs):
                for n in sizes:
                    order = round_order(rng, active, firsts[n][run])
                    for position, (variant, pair) in enumerate(order):
                        if variant in HUGEPAGE_VARIANTS and reservation is not None:
                            reservation.top_up()
                        reporting = FreePageReporting().wait_quiet() if pages == "cold" else None
                        sample = spawn(variant, n, pages)
                        sample.update(run=run, position=position, pair=pair)
                        if reporting is not None:
                            sample["reporting_wait"] = reporting
                        samples.append(sample)
                        shown = (
                            f"error: {sample['error']}"
                            if "error" in sample
                            else f"{sample['seconds']:.3f} s "
                            f"({gib_per_s(n, sample['seconds']):.2f} GiB/s)"
                        )
                        print(
                            f"run {run + 1}/{runs} {format_size(n):>7} {variant:<27} {shown}",
                            file=sys.stderr,
                        )
        finally:
            if reservation is not None:
                reservation.restore()

    results = summarise(sizes, variants, samples, skipped)
    data: dict[str, Any] = {
        "benchmark": "populate",
        "schema": 1,
        "date": started,
        "finished": utc_now(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "config": {
            "sizes_bytes": sizes,
            "runs": runs,
            "quick": quick,
            "variants": variants,
            "baseline": BASELINE,
            "pages": pages,
            "pages_meaning": PAGES_HELP[pages],
            "interleaving": "per round and size, variants in a new random order (seed "
            f"{ORDER_SEED}), so no variant keeps its place or the neighbour whose freed "
            "pages it meets",
            "same_work": {
                "variants": list(SAME_WORK),
                "pairs_per_round": SAME_WORK_PAIRS,
                "first_in_pair": "each side first in exactly half of a size's pairs",
            },
            "timed": "allocate + populate + tensor creation; no interpreter or import time",
            "warmup_bytes": WARMUP_BYTES,
            "populate_threads": THREADS,
            "residency_check": "mincore over the tensor, plus fstat st_blocks for fd-backed",
        },
        "machine": machine,
        "variant_descriptions": {v: VARIANTS[v] for v in variants},
        "hugepages": hugepages,
        "samples": samples,
        "results": results,
        "targets": [evaluate(t, results) for t in TARGETS],
    }
    return data


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="1GiB,4GiB", help="comma-separated (default %(default)s)"
    )
    parser.add_argument("--runs", type=int, default=5, help="rounds per variant (default 5)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 64 MiB, 1 run")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset (default: all)"
    )
    parser.add_argument(
        "--pages",
        choices=list(PAGES_HELP),
        default="warm",
        help="page state before each sample (default %(default)s): "
        + "; ".join(f"{k}: {v}" for k, v in PAGES_HELP.items()),
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="default %(default)s")
    parser.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one is not None:  # child mode
        if not args.bytes or args.bytes <= 0:
            parser.error("--one needs --bytes N > 0")
        print(json.dumps(run_one(args.one, args.bytes, args.pages)), flush=True)
        return 0

    try:
        sizes = [64 * MiB] if args.quick else [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    runs = 1 if args.quick else args.runs
    if runs < 1:
        parser.error("--runs must be >= 1")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.pages == "cold" and FreePageReporting().counters() is None:
        parser.error(
            f"--pages cold needs {PAGE_REPORTING}/reported_kib and passes to tell when free "
            "page reporting is done; this kernel does not show them (without reporting, "
            "as on bare metal, cold is the same as --pages natural)"
        )
    need = max(sizes) * 2 + GiB
    available = meminfo().get("MemAvailable", 0)
    if available < need:
        print(
            f"warning: MemAvailable {format_size(available)} < {format_size(need)}: "
            "populate may fail or swap",
            file=sys.stderr,
        )

    data = run_all(sizes, runs, variants, args.quick, args.pages)
    write_json(args.output, data)
    print_table(data)
    print(f"\nwrote {args.output}")
    failed = [t for t in data["targets"] if t["pass"] is False and t["kind"] == "required"]
    if failed:
        print(f"{len(failed)} required target(s) failed", file=sys.stderr)
    return 0  # a benchmark reports; it does not gate (`make bench` goes on to report.py)


if __name__ == "__main__":
    sys.exit(main())
