"""H2D/D2H bandwidth of a shm pool pinned by hostpool vs torch.empty(pin_memory=True),
and pin/unpin time for 8 GiB. Needs a CUDA GPU; writes bench/results/gpu_pin.json.

Pinning goes through hostpool's runtime seam (chunked cudaHostRegister); the unpin time
is the release of the pinned region (cudaHostUnregister of every chunk before munmap).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostpool import HostPoolManager

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_pin.json"


def bandwidth(host: torch.Tensor, device: torch.Tensor, runs: int) -> dict[str, float]:
    def timed(copy: Any) -> float:
        samples = []
        for _ in range(runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return host.numel() / statistics.median(samples) / 2**30

    return {
        "h2d_gib_s": timed(lambda: device.copy_(host, non_blocking=True)),
        "d2h_gib_s": timed(lambda: host.copy_(device, non_blocking=True)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pin-bytes", type=int, default=8 << 30)
    parser.add_argument("--copy-bytes", type=int, default=1 << 30)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_pin: no CUDA device here; nothing measured (docs/benchmarks.md says so)")
        return 2
    device = torch.empty(args.copy_bytes, dtype=torch.uint8, device="cuda")
    result: dict[str, Any] = {"benchmark": "gpu_pin", "gpu": torch.cuda.get_device_name()}
    with HostPoolManager() as manager:
        t0 = time.perf_counter()
        pinned = manager.allocator("pinned", pin=True).allocate((args.pin_bytes,), torch.uint8)
        result["hostpool_pin_8g_s"] = time.perf_counter() - t0
        result["hostpool"] = bandwidth(pinned[: args.copy_bytes], device, args.runs)
        t0 = time.perf_counter()
        manager.allocator("pinned").release(pinned)
        del pinned
        result["hostpool_unpin_8g_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = torch.empty(args.pin_bytes, dtype=torch.uint8, pin_memory=True)
    result["torch_pin_8g_s"] = time.perf_counter() - t0
    result["torch"] = bandwidth(ref[: args.copy_bytes], device, args.runs)
    del ref
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
