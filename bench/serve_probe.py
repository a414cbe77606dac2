"""`hostpool serve` answering while it populates: probe latencies during a big populate.

Starts `hostpool serve --pool kv=SIZE --port 0` (default 16 GiB) as a real subprocess,
reads its address from the `hostpool.listening` log line (logged as HTTP starts, before
the first page is populated), then until /readyz answers 200 probes /healthz, /readyz
and /metrics in turn from this process, each on a new connection, with a short pause
between rounds. Latency is the wall time of one whole GET (connect, request, body).
Reports p50/p99/max per endpoint over the populate, how many probes /readyz refused
(503 while populating), and the populate time (listening to ready, and each pool's
`seconds` from `hostpool.pool_ready`). Also the CPU the rest of the machine used.

MemAvailable is checked first: the run refuses a size that would leave less than 2 GiB
to the rest of the machine (use --size 8GiB then).

Target: p99 <= 0.1 s for /healthz and /metrics (and /readyz) during populate.
Writes bench/results/serve_probe.json.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    RESULTS_DIR,
    format_size,
    other_cpu,
    parse_size,
    start_serve,
    too_big,
    write_result,
)

RESULTS = RESULTS_DIR / "serve_probe.json"
P99_TARGET_S = 0.1
ENDPOINTS = ("/healthz", "/readyz", "/metrics")
TIMEOUT_S = 30.0  # a probe that takes this long counts as this long (and fails the target)


def probe(url: str) -> tuple[int, float]:
    """(HTTP status, seconds) of one GET on a new connection; status 0 on a timeout."""
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            r.read()
            status = int(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        status = e.code
    except TimeoutError:
        status = 0
    return status, time.perf_counter() - start


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (q in 0..1) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]


def run(size: int, pause: float) -> dict[str, Any]:
    proc, lines = start_serve(size)
    samples: dict[str, list[tuple[int, float]]] = {e: [] for e in ENDPOINTS}
    try:
        base = lines.wait_for(r'"url": "(http://[^"]+?)/"', proc).group(1)
        listening = time.monotonic()
        ready_at = None
        with other_cpu() as others:
            while ready_at is None:
                for endpoint in ENDPOINTS:
                    status, seconds = probe(base + endpoint)
                    samples[endpoint].append((status, seconds))
                    if endpoint == "/readyz" and status == 200:
                        ready_at = time.monotonic()
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited {proc.returncode} before it was ready")
                time.sleep(pause)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines.join()
    if code != 0:
        raise RuntimeError(f"serve exited {code}")
    log = [json.loads(x) for x in lines.lines if x.startswith("{")]
    pools = {e["pool"]: e["seconds"] for e in log if e["event"] == "hostpool.pool_ready"}
    endpoints = {}
    for endpoint, got in samples.items():
        latencies = [s for _, s in got]
        endpoints[endpoint] = {
            "probes": len(got),
            "statuses": {str(c): sum(1 for s, _ in got if s == c) for c in {s for s, _ in got}},
            "p50_s": quantile(latencies, 0.5),
            "p99_s": quantile(latencies, 0.99),
            "max_s": max(latencies),
        }
    return {
        "bytes": size,
        "pause_between_rounds_s": pause,
        "populate_s": ready_at - listening,
        "pool_ready_seconds": pools,
        "other_cpus": others["other_cpus"],
        "endpoints": endpoints,
        "target_met": all(e["p99_s"] <= P99_TARGET_S for e in endpoints.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16GiB", help="the pool's size (default 16GiB)")
    parser.add_argument("--pause", type=float, default=0.01, help="seconds between rounds")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    size = parse_size(args.size)
    refused = too_big(size)
    if refused is not None:
        print(f"{refused}: use a smaller --size", file=sys.stderr)
        return 1
    result = run(size, args.pause)
    for endpoint, e in result["endpoints"].items():
        print(
            f"{endpoint}: {e['probes']} probes, p50 {e['p50_s'] * 1000:.1f} ms, p99 "
            f"{e['p99_s'] * 1000:.1f} ms, max {e['max_s'] * 1000:.1f} ms, {e['statuses']}",
            file=sys.stderr,
        )
    print(
        f"populate {format_size(size)}: {result['populate_s']:.2f} s; other cpus "
        f"{result['other_cpus']:.2f}; target p99 <= {P99_TARGET_S} s: "
        f"{'met' if result['target_met'] else 'MISSED'}",
        file=sys.stderr,
    )
    write_result(
        args.output,
        benchmark="serve_probe",
        targets={"p99_s": P99_TARGET_S},
        result=result,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
