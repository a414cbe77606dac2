"""First-allocation cost: what a process pays for its first hostpool allocation.

Each sample is a fresh interpreter (`python bench/first_alloc.py --child`) that imports
torch (timed apart, not counted), then times, on top of it: `from hostpool import
ShmHostTensorAllocator` (import), the allocator's construction, the first 2 MiB
`allocate()` (with its lazy probes) and, for contrast, a second one. The target is the
sum of the first three, import + construction + first call, under 50 ms.

Writes bench/results/first_alloc.json; `bench/report.py` renders it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS_DIR, machine_facts, other_cpu, utc_now, write_json

RESULTS = RESULTS_DIR / "first_alloc.json"
SIZE = 2 << 20
TARGET_MS = 50.0
PHASES = ("import", "construct", "first_call")


def child() -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    c1 = time.process_time()
    from hostpool import ShmHostTensorAllocator

    t2 = time.perf_counter()
    alloc = ShmHostTensorAllocator("first")
    t3 = time.perf_counter()
    first = alloc.allocate((SIZE,), torch.uint8)
    t4 = time.perf_counter()
    c4 = time.process_time()
    second = alloc.allocate((SIZE,), torch.uint8)
    t5 = time.perf_counter()
    if alloc.regions[0].resident_bytes() < SIZE:
        raise RuntimeError("first allocation not resident")
    del first, second
    alloc.close()
    ms = 1e3
    return {
        "import_torch_ms": (t1 - t0) * ms,
        "import_ms": (t2 - t1) * ms,
        "construct_ms": (t3 - t2) * ms,
        "first_call_ms": (t4 - t3) * ms,
        "second_call_ms": (t5 - t4) * ms,
        "total_ms": (t4 - t1) * ms,
        # CPU time of the same span (all threads): what neighbours' load cannot inflate
        "total_cpu_ms": (c4 - c1) * ms,
        "modules_loaded": sorted(m for m in sys.modules if m.startswith("hostpool")),
    }


def spawn(pycache: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child"]
    # Bytecode cached as on an installed host (pip compiles what it installs), kept out
    # of the tree; PYTHONDONTWRITEBYTECODE would have every sample compile hostpool anew.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = pycache
    with other_cpu() as others:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, check=False, env=env
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    sample: dict[str, Any] = json.loads(lines[-1])
    sample["other_cpus"] = others["other_cpus"]
    return sample


def summarise(samples: list[dict[str, Any]]) -> dict[str, Any]:
    good = [s for s in samples if "error" not in s]
    keys = (
        "import_torch_ms",
        *(f"{p}_ms" for p in PHASES),
        "second_call_ms",
        "total_ms",
        "total_cpu_ms",
    )
    medians = {k: statistics.median(s[k] for s in good) for k in keys} if good else {}
    return {
        "median": medians,
        "min_total_ms": min((s["total_ms"] for s in good), default=None),
        "max_total_ms": max((s["total_ms"] for s in good), default=None),
        "errors": [s["error"] for s in samples if "error" in s],
        "pass": medians["total_ms"] < TARGET_MS if medians else None,
        "other_cpus_median": statistics.median(s["other_cpus"] for s in good) if good else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=15, help="fresh processes (15)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="default %(default)s")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child()), flush=True)
        return 0
    if args.samples < 1:
        parser.error("--samples must be >= 1")
    started = utc_now()
    pycache = tempfile.mkdtemp(prefix="hostpool-bench-pycache-")
    try:
        spawn(pycache)  # discarded: fills the page cache and the bytecode cache
        samples = []
        for i in range(args.samples):
            sample = spawn(pycache)
            samples.append(sample)
            shown = sample.get("error") or f"{sample['total_ms']:.1f} ms"
            print(f"sample {i + 1}/{args.samples}: {shown}", file=sys.stderr)
    finally:
        shutil.rmtree(pycache, ignore_errors=True)
    data = {
        "benchmark": "first_alloc",
        "schema": 1,
        "date": started,
        "finished": utc_now(),
        "size_bytes": SIZE,
        "target_ms": TARGET_MS,
        "timed": "after `import torch`: import hostpool + construct the allocator + the "
        "first 2 MiB allocate() with its lazy probes (second call shown apart); bytecode "
        "cached, as on an installed host",
        "machine": machine_facts(),
        "samples": samples,
        **summarise(samples),
    }
    write_json(args.output, data)
    m = data["median"]
    if m:
        print(
            f"first allocation: {m['total_ms']:.1f} ms median on top of import torch "
            f"(import {m['import_ms']:.1f}, construct {m['construct_ms']:.2f}, first call "
            f"{m['first_call_ms']:.1f}; second call {m['second_call_ms']:.1f}); target < "
            f"{TARGET_MS:.0f} ms: {'pass' if data['pass'] else 'FAIL'}"
        )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
