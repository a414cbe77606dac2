"""Wrong basic-auth passwords in a flood: do /healthz and real scrapes still answer?

For each target (`hostpool serve --pool kv=4MiB` and `hostpool exporter`, real
subprocesses, plain HTTP with basic auth, one user with a bcrypt hash of cost 10; bcrypt's
default is 12), on loopback:
- quiet: this process probes, each on a new connection, GET /healthz and GET /metrics
  with the right password in turn, `--pause` apart, for `--quiet` seconds;
- flood: the same probes while a flooder (another process, so its CPU does not slow the
  probes' own clock) opens `--rate` connections a second for `--flood` seconds, open
  loop (it does not wait for answers), each with a new wrong password (no cache can
  answer it) from the next of 200 loopback addresses (127.0.0.2...: a per-address
  back-off alone cannot answer it either), each giving up after 2 s.
Reports p50/p99/max of each probe in both phases, the flood's answers by status, the
server's CPU (seconds of CPU per second) in both phases and the failed logins it logged.

Target: p99 <= 1 s for /healthz and /metrics during the flood.
Writes bench/results/auth_flood.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bcrypt
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO_ROOT, RESULTS_DIR, machine_facts, other_cpu, utc_now, write_json
from bench.serve_probe import quantile

RESULTS = RESULTS_DIR / "auth_flood.json"
P99_TARGET_S = 1.0
COST = 10
PASSWORD = "bench-password"
SOURCES = 200  # loopback addresses the flood comes from
FLOOD_GIVE_UP_S = 2.0
PROBE_TIMEOUT_S = 30.0  # a probe that takes this long counts as this long
TARGETS = {
    "serve": ["serve", "--pool", "kv=4MiB"],
    "exporter": ["exporter", "--pid", str(os.getpid())],
}


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@contextmanager
def serving(work: Path, target: str, config: Path) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """`hostpool TARGET --port 0` with the web config; yields (port, process)."""
    log = work / f"{target}.err"
    args = [sys.executable, "-m", "hostpool", "--log-format", "json", *TARGETS[target]]
    args += ["--port", "0", "--web-config-file", str(config)]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True
        )
    try:
        deadline = time.monotonic() + 120
        while (match := re.search(r'"url": "http://[^:]+:(\d+)/metrics"', log.read_text())) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{target} did not start: {log.read_text()}")
            time.sleep(0.05)
        yield int(match.group(1)), proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def probe(port: int, path: str, auth: str) -> tuple[int, float]:
    """(status, seconds) of one GET on a new connection; status 0 when it failed."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_TIMEOUT_S)
    try:
        conn.request("GET", path, headers={"Authorization": auth})
        response = conn.getresponse()
        response.read()
        status = response.status
    except (OSError, http.client.HTTPException):
        status = 0
    finally:
        conn.close()
    return status, time.perf_counter() - start


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def probing(port: int, seconds: float, pause: float, server: psutil.Process) -> dict[str, Any]:
    """Probe /healthz and /metrics in turn for `seconds`; their figures and the server's CPU."""
    auth = basic("alice", PASSWORD)
    got: dict[str, list[tuple[int, float]]] = {"/healthz": [], "/metrics": []}
    cpu0, start = cpu_seconds(server), time.monotonic()
    while time.monotonic() - start < seconds:
        for path, samples in got.items():
            samples.append(probe(port, path, auth))
        time.sleep(pause)
    wall = time.monotonic() - start
    out: dict[str, Any] = {"server_cpus": (cpu_seconds(server) - cpu0) / wall}
    for path, samples in got.items():
        latencies = [s for _, s in samples]
        out[path] = {
            "probes": len(samples),
            "ok": sum(1 for status, _ in samples if status == 200),
            "p50_s": quantile(latencies, 0.5),
            "p99_s": quantile(latencies, 0.99),
            "max_s": max(latencies),
        }
    return out


async def _one(port: int, source: str, password: str) -> str:
    request = (
        f"GET /metrics HTTP/1.1\r\nHost: flood\r\nAuthorization: {basic('alice', password)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    writer = None
    try:
        async with asyncio.timeout(FLOOD_GIVE_UP_S):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
            writer.write(request)
            line = await reader.readline()
            return line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "no answer"
    except TimeoutError:
        return "gave up"
    except OSError:
        return "error"
    finally:
        if writer is not None:
            writer.close()


async def _flood(port: int, rate: float, seconds: float) -> dict[str, int]:
    start = asyncio.get_running_loop().time()
    tasks = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)
        source = f"127.0.{(i % SOURCES) // 254}.{(i % SOURCES) % 254 + 2}"
        tasks.append(asyncio.create_task(_one(port, source, os.urandom(12).hex())))
    outcomes: dict[str, int] = {}
    for outcome in await asyncio.gather(*tasks):
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def failed_logins(log: Path) -> dict[str, int]:
    """The server's hostpool.http_unauthorized events summed by `why`."""
    totals: dict[str, int] = {}
    for line in log.read_text().splitlines():
        if '"hostpool.http_unauthorized"' in line:
            event = json.loads(line)
            totals[event["why"]] = totals.get(event["why"], 0) + int(event.get("count", 1))
    return totals


def run_target(work: Path, target: str, config: Path, args: argparse.Namespace) -> dict[str, Any]:
    with serving(work, target, config) as (port, proc):
        server = psutil.Process(proc.pid)
        probe(port, "/metrics", basic("alice", PASSWORD))  # the right password, cached
        quiet = probing(port, args.quiet, args.pause, server)
        flooder = subprocess.Popen(
            [sys.executable, __file__, "--flooder", str(port), str(args.rate), str(args.flood)],
            stdout=subprocess.PIPE,
            text=True,
        )
        flood = probing(port, args.flood, args.pause, server)
        out, _ = flooder.communicate(timeout=args.flood + 60)
        flood["flood_answers"] = json.loads(out)
        # the failed-login events of the flood's tail are flushed on the throttle's timer
        time.sleep(args.log_interval)
    flood["failed_logins_logged"] = failed_logins(work / f"{target}.err")
    return {"quiet": quiet, "flood": flood}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="flood connections/s (100)")
    parser.add_argument("--flood", type=float, default=20.0, help="flood seconds (20)")
    parser.add_argument("--quiet", type=float, default=10.0, help="seconds without flood (10)")
    parser.add_argument("--pause", type=float, default=0.05, help="between probe rounds (0.05)")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS))
    parser.add_argument("--log-interval", type=float, default=11.0, help=argparse.SUPPRESS)
    parser.add_argument("--flooder", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flooder:
        port, rate, seconds = args.flooder
        print(json.dumps(asyncio.run(_flood(int(port), float(rate), float(seconds)))))
        return 0
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(COST)).decode()
    t0 = time.perf_counter()
    bcrypt.checkpw(b"wrong", hashed.encode())
    round_s = time.perf_counter() - t0
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, other_cpu() as others:
        work = Path(tmp)
        config = work / "web.yml"
        config.write_text(f"basic_auth_users:\n  alice: '{hashed}'\n")
        for target in args.target or sorted(TARGETS):
            results[target] = run_target(work, target, config, args)
            print(target, json.dumps(results[target]), flush=True)
    met = all(
        r["flood"][path]["p99_s"] <= P99_TARGET_S
        and r["flood"][path]["ok"] == r["flood"][path]["probes"]
        for r in results.values()
        for path in ("/healthz", "/metrics")
    )
    write_json(
        RESULTS,
        {
            "generated_at": utc_now(),
            "machine": machine_facts(),
            "bcrypt_cost": COST,
            "bcrypt_round_s": round_s,
            "rate_per_s": args.rate,
            "flood_s": args.flood,
            "quiet_s": args.quiet,
            "sources": SOURCES,
            "other_cpus": others["other_cpus"],
            "targets": results,
            "p99_target_s": P99_TARGET_S,
            "met": met,
        },
    )
    print(f"met: {met}; other cpus {others['other_cpus']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
