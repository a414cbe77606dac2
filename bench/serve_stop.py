"""How fast `hostpool serve` leaves after SIGTERM, next to a bare process holding the same bytes.

Per size (default 1, 4 and 16 GiB), in rounds whose order alternates (each side first in
half of them):
- serve: `hostpool serve --pool kv=SIZE --port 0`; once /readyz answers 200 (every page
  populated), SIGTERM, then the time until the process has exited (waitpid). From its
  JSON log: the time from the last release (`hostpool.release` or `hostpool.pool_closed`)
  and from `hostpool.serve_stopped` to the exit (the interpreter's teardown);
- bare: a Python process that memfd_create()s, ftruncate()s, mmap()s and populates the
  same bytes with MADV_POPULATE_WRITE through ctypes (two threads), then on SIGTERM
  munmap()s, closes and exits: what unmapping that much shmem costs the kernel, plus the
  smallest interpreter exit.
The ratio is serve / bare per round; the medians are reported. Also the CPU the rest of
the machine used meanwhile (`other_cpus`).

Targets: serve exits within 0.5 s of its last release; SIGTERM-to-exit <= 1.2x bare.
Writes bench/results/serve_stop.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import statistics
import subprocess
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

RESULTS = RESULTS_DIR / "serve_stop.json"
RATIO_TARGET = 1.2
TAIL_TARGET_S = 0.5
DEADLINE_S = 600.0  # an upper bound for populating 16 GiB on a busy host, not a figure

BARE = r"""
import ctypes, os, signal, sys, threading
size = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
fd = os.memfd_create("bare.kv", os.MFD_CLOEXEC)
os.ftruncate(fd, size)
addr = libc.mmap(None, size, 3, 1, fd, 0)  # PROT_READ|PROT_WRITE, MAP_SHARED
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
span = 64 << 20
spans = [(addr + off, min(span, size - off)) for off in range(0, size, span)]
def work(mine):
    for start, n in mine:
        if libc.madvise(start, n, 23) != 0:  # MADV_POPULATE_WRITE
            os._exit(3)
threads = [threading.Thread(target=work, args=(spans[i::2],)) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print("ready", flush=True)
signal.sigwait({signal.SIGTERM})
libc.munmap(addr, size)
os.close(fd)
sys.exit(0)
"""


def _wall(stamp: str) -> float:
    """A log line's ISO timestamp (UTC) as seconds since the epoch."""
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=30) as r:
            return bool(r.status == 200)
    except urllib.error.HTTPError:
        return False


def stop_serve(size: int) -> dict[str, Any]:
    proc, lines = start_serve(size)
    try:
        match = lines.wait_for(r'"url": "(http://[^"]+?)/?"', proc)
        url = match.group(1).removesuffix("/metrics")
        started = time.monotonic()
        while not _ready(url):  # a poll, no event to block on from outside
            if proc.poll() is not None or time.monotonic() - started > DEADLINE_S:
                raise RuntimeError(f"serve never became ready (exit {proc.poll()})")
            time.sleep(0.05)
        t0_wall, t0 = time.time(), time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
        t1, t1_wall = time.monotonic(), time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines.join()
    log = [json.loads(x) for x in lines.lines if x.startswith("{")]
    if code != 0:
        raise RuntimeError(f"serve exited {code}: {lines.lines[-5:]}")
    stopped = [e for e in log if e["event"] == "hostpool.serve_stopped"]
    # one `hostpool.release` per region, or one `hostpool.pool_closed` per pool
    releases = [e for e in log if e["event"] in ("hostpool.release", "hostpool.pool_closed")]
    last_release = max(_wall(e["timestamp"]) for e in releases)
    return {
        "sigterm_to_exit_s": t1 - t0,
        "sigterm_to_last_release_s": last_release - t0_wall,
        "last_release_to_exit_s": t1_wall - last_release,
        "serve_stopped_to_exit_s": t1_wall - _wall(stopped[-1]["timestamp"]),
    }


def stop_bare(size: int) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, "-c", BARE, str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"bare process failed (exit {proc.wait()})")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
        t1 = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0:
        raise RuntimeError(f"bare process exited {code}")
    return {"sigterm_to_exit_s": t1 - t0}


def run_size(size: int, rounds: int) -> dict[str, Any]:
    serve: list[dict[str, Any]] = []
    bare: list[dict[str, Any]] = []
    with other_cpu() as others:
        for i in range(rounds):
            order = (("serve", stop_serve), ("bare", stop_bare))
            for name, fn in order if i % 2 == 0 else order[::-1]:
                (serve if name == "serve" else bare).append(fn(size))
    ratios = [
        s["sigterm_to_exit_s"] / b["sigterm_to_exit_s"] for s, b in zip(serve, bare, strict=True)
    ]

    def median(samples: list[dict[str, Any]], key: str) -> float:
        return statistics.median(s[key] for s in samples)

    return {
        "bytes": size,
        "rounds": rounds,
        "serve": serve,
        "bare": bare,
        "ratios": ratios,
        "other_cpus": others["other_cpus"],
        "median": {
            "serve_sigterm_to_exit_s": median(serve, "sigterm_to_exit_s"),
            "serve_last_release_to_exit_s": median(serve, "last_release_to_exit_s"),
            "serve_stopped_to_exit_s": median(serve, "serve_stopped_to_exit_s"),
            "bare_sigterm_to_exit_s": median(bare, "sigterm_to_exit_s"),
            "ratio": statistics.median(ratios),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1GiB,4GiB,16GiB", help="comma-separated sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cases: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for size in sizes:
        refused = too_big(size)
        if refused is not None:
            skipped[format_size(size)] = refused
            print(f"{format_size(size)}: skipped ({skipped[format_size(size)]})", file=sys.stderr)
            continue
        case = cases[format_size(size)] = run_size(size, args.rounds)
        m = case["median"]
        print(
            f"{format_size(size)}: serve {m['serve_sigterm_to_exit_s']:.3f} s, bare "
            f"{m['bare_sigterm_to_exit_s']:.3f} s, ratio {m['ratio']:.2f}; last release -> "
            f"exit {m['serve_last_release_to_exit_s']:.3f} s, serve_stopped -> exit "
            f"{m['serve_stopped_to_exit_s']:.3f} s; other cpus {case['other_cpus']:.2f}",
            file=sys.stderr,
        )
    write_result(
        args.output,
        benchmark="serve_stop",
        targets={"ratio": RATIO_TARGET, "last_release_to_exit_s": TAIL_TARGET_S},
        cases=cases,
        skipped=skipped,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
