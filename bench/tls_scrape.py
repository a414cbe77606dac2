"""What TLS and basic auth cost a scrape of `hostpool serve`, side by side in one run.

Three real `hostpool serve --pool kv=4MiB` processes: plain HTTP; TLS; TLS with basic
auth (a bcrypt hash of cost 10, bcrypt's default is 12). Per round, in an order that
rotates (each side in each place equally often), GET /metrics from each:
- keepalive: on a connection kept open (as Prometheus does), the request alone;
- fresh: a new connection each time (TCP, and the TLS handshake where there is one).
Also, in this process, `BasicAuth.check` on a cache hit next to a bcrypt round (a miss).
Wall time per sample; ratios are each side over plain per round. `other_cpus`: the CPU the
rest of the machine used meanwhile.

Targets: a keep-alive scrape with TLS and basic auth <= 1.5x a plain one (the bcrypt
round is cached); a cached auth check <= 1% of a bcrypt round.
Writes bench/results/tls_scrape.json.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import re
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bcrypt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO_ROOT, RESULTS_DIR, machine_facts, other_cpu, utc_now, write_json
from hostpool.net.basicauth import BasicAuth
from tests import tlspki

RESULTS = RESULTS_DIR / "tls_scrape.json"
KEEPALIVE_TARGET = 1.5
CACHE_TARGET = 0.01
PASSWORD = "bench-password"
SIDES = ("plain", "tls", "tls_auth")


@contextmanager
def serving(work: Path, name: str, config: str | None) -> Iterator[int]:
    """A `hostpool serve` subprocess; yields its port once it serves /metrics."""
    log = work / f"{name}.err"
    args = [sys.executable, "-m", "hostpool", "serve", "--pool", "kv=4MiB", "--port", "0"]
    if config is not None:
        args += ["--web-config-file", config]
    with open(log, "w") as err:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while (
            match := re.search(r'"url": "https?://[^:]+:(\d+)/metrics"', log.read_text())
        ) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve {name} did not start: {log.read_text()}")
            time.sleep(0.05)
        yield int(match.group(1))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def connection(port: int, context: ssl.SSLContext | None) -> http.client.HTTPConnection:
    if context is None:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    return http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=60)


def scrape(conn: http.client.HTTPConnection, headers: dict[str, str]) -> None:
    conn.request("GET", "/metrics", headers=headers)
    response = conn.getresponse()
    body = response.read()
    if response.status != 200 or b"hostpool_allocated_bytes" not in body:
        raise RuntimeError(f"scrape failed: {response.status} {body[:200]!r}")


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def auth_costs(hashed: bytes, repeat: int) -> dict[str, float]:
    def ok(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        return []

    cached = BasicAuth({"alice": hashed}, ok)
    cached.check("alice", PASSWORD)
    hit = statistics.median(timed(lambda: cached.check("alice", PASSWORD)) for _ in range(repeat))
    fresh = BasicAuth({"alice": hashed}, ok, ttl=0.0)
    miss = statistics.median(
        timed(lambda: fresh.check("alice", PASSWORD)) for _ in range(max(3, repeat // 20))
    )
    return {"cache_hit_s": hit, "bcrypt_round_s": miss, "ratio": hit / miss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds of each side (30)")
    args = parser.parse_args()
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10))
    headers = {"Authorization": "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tlspki.make(work)
        tls = work / "tls.yml"
        tls.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
        auth = work / "tls_auth.yml"
        auth.write_text(tls.read_text() + f"basic_auth_users:\n  alice: '{hashed.decode()}'\n")
        context = ssl.create_default_context(cafile=str(work / "ca.crt"))
        contexts = {"plain": None, "tls": context, "tls_auth": context}
        sends = {"plain": {}, "tls": {}, "tls_auth": headers}
        with (
            serving(work, "plain", None) as plain,
            serving(work, "tls", str(tls)) as tls_port,
            serving(work, "tls_auth", str(auth)) as auth_port,
        ):
            ports = {"plain": plain, "tls": tls_port, "tls_auth": auth_port}
            kept = {side: connection(ports[side], contexts[side]) for side in SIDES}
            for side in SIDES:  # warm: connections open, the auth cache filled
                scrape(kept[side], sends[side])
            samples: dict[str, dict[str, list[float]]] = {
                mode: {side: [] for side in SIDES} for mode in ("keepalive", "fresh")
            }
            ratios: dict[str, dict[str, list[float]]] = {
                mode: {side: [] for side in SIDES[1:]} for mode in ("keepalive", "fresh")
            }

            def fresh(side: str) -> None:
                conn = connection(ports[side], contexts[side])
                try:
                    scrape(conn, sends[side])
                finally:
                    conn.close()

            with other_cpu() as others:
                for r in range(args.rounds):
                    order = SIDES[r % 3 :] + SIDES[: r % 3]
                    got: dict[str, dict[str, float]] = {"keepalive": {}, "fresh": {}}
                    for side in order:
                        conn, send = kept[side], sends[side]
                        got["keepalive"][side] = timed(lambda: scrape(conn, send))  # noqa: B023
                        got["fresh"][side] = timed(lambda: fresh(side))  # noqa: B023
                    for mode, times in got.items():
                        for side, t in times.items():
                            samples[mode][side].append(t)
                        for side in SIDES[1:]:
                            ratios[mode][side].append(times[side] / times["plain"])
            for conn in kept.values():
                conn.close()
    result: dict[str, Any] = {
        "generated_at": utc_now(),
        "machine": machine_facts(),
        "rounds": args.rounds,
        "other_cpus": others["other_cpus"],
        "median_s": {
            mode: {side: statistics.median(v) for side, v in by.items()}
            for mode, by in samples.items()
        },
        "median_ratio_to_plain": {
            mode: {side: statistics.median(v) for side, v in by.items()}
            for mode, by in ratios.items()
        },
        "auth": auth_costs(hashed, 200),
        "targets": {"keepalive_tls_auth_ratio": KEEPALIVE_TARGET, "cache_ratio": CACHE_TARGET},
    }
    keep = result["median_ratio_to_plain"]["keepalive"]["tls_auth"]
    result["met"] = {
        "keepalive_tls_auth_ratio": keep <= KEEPALIVE_TARGET,
        "cache_ratio": result["auth"]["ratio"] <= CACHE_TARGET,
    }
    write_json(RESULTS, result)
    for mode in ("keepalive", "fresh"):
        line = ", ".join(f"{side} {result['median_s'][mode][side] * 1e3:.2f} ms" for side in SIDES)
        print(f"{mode}: {line}; ratios {result['median_ratio_to_plain'][mode]}")
    print(f"auth: {result['auth']}; other cpus {others['other_cpus']:.2f}; met {result['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
