"""What the broker saves an engine at restart: attaching a populated pool vs populating it,
and (with --engine) a real vLLM server's restart to its first token with vs without it.

Attach vs populate (default 8 GiB, the issue's size; run it on a quiet machine: it holds
the pool while lessees map it):
- populate: `hostpool serve --pool bench=SIZE` allocates and populates the pool; its own
  `hostpool.pool_ready` event says how long that took (what an engine pays at every
  start when it owns its host cache);
- attach (`lease_s`): a lessee process leases the populated pool
  (`hostpool.broker.lease`: connect, manifest, SCM_RIGHTS, checks, the chunks mapped
  side by side). That is all an engine pays at restart: its first touch of each page is
  a minor fault on a page already there (nothing allocated, nothing zeroed);
- and, apart, prefaulting the whole mapping after the lease (`lease_and_prefault_s`,
  MADV_POPULATE_WRITE: one page-table entry per 4 KiB page, ~2M for 8 GiB), for a lessee
  that wants no fault later.
Each lessee is a new process. Target: attach <= 5% of populate.

Engine restart (--engine; ~4 vLLM starts, minutes): the tiny model of tests/vllm on the
CPU build, a prompt of 384 shared tokens stored, the whole process group killed with
SIGKILL, a new server started: wall time from its start to its first token for that
prompt, and the prefix tokens it loaded from the host tier (vLLM's
`vllm:external_prefix_cache_hits_total`), with the broker and without (the stock
hostpool spec: its host cache dies with the engine). On this tiny model prefill is cheap:
the figure shows the mechanism, not a large model's saving.

Also the CPU the rest of the machine used meanwhile (`other_cpus`). Writes
bench/results/broker_restart.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    REPO_ROOT,
    RESULTS_DIR,
    GiB,
    format_size,
    other_cpu,
    parse_size,
    write_result,
)

RESULTS = RESULTS_DIR / "broker_restart.json"
TARGET_ATTACH_SHARE = 0.05

LESSEE = """
import json, sys, time
t0 = time.perf_counter()
from hostpool.broker import lease
from hostpool.memory import syscalls
imported = time.perf_counter() - t0
t0 = time.perf_counter()
l = lease(sys.argv[1], "bench")
leased = time.perf_counter() - t0
syscalls.madvise(l.address, l.size, syscalls.MADV_POPULATE_WRITE)
attached = time.perf_counter() - t0
print(json.dumps({"lease_s": leased, "lease_and_prefault_s": attached, "bytes": l.size,
                  "import_s": imported}))
l.close()
"""


def start_serve(size: int, sock: str, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    """`hostpool serve` with the pool; returns it once serving, and its populate seconds."""
    cmd = [sys.executable, "-m", "hostpool", "serve", "--port", "0", "--log-format", "json",
           "--pool", f"bench={size}", "--share-socket", sock]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=log.open("wb"))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if '"hostpool.serving"' in text:
            ready = [json.loads(x) for x in text.splitlines() if '"hostpool.pool_ready"' in x]
            return proc, float(ready[0]["seconds"])
        if proc.poll() is not None:
            raise RuntimeError(f"hostpool serve exited {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("hostpool serve did not serve within 600 s")


def attach_vs_populate(size: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hostpool-bench-broker-") as tmp:
        sock = os.path.join(tmp, "run", "broker.sock")
        samples = []
        with other_cpu() as load:
            proc, populate_s = start_serve(size, sock, Path(tmp) / "serve.log")
            try:
                for _ in range(rounds):
                    out = subprocess.run(
                        [sys.executable, "-c", textwrap.dedent(LESSEE), sock],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=True,
                    )  # fmt: skip
                    samples.append(json.loads(out.stdout))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=600)
    lease_s = statistics.median(s["lease_s"] for s in samples)
    prefault = statistics.median(s["lease_and_prefault_s"] for s in samples)
    return {
        "bytes": size,
        "populate_s": populate_s,
        "lease_s": lease_s,
        "lease_and_prefault_s": prefault,
        "lease_share_of_populate": lease_s / populate_s,
        "lease_and_prefault_share_of_populate": prefault / populate_s,
        "target_share": TARGET_ATTACH_SHARE,
        "meets_target": lease_s / populate_s <= TARGET_ATTACH_SHARE,
        "rounds": samples,
        "other_cpus": load["other_cpus"],
    }


PR_SET_CHILD_SUBREAPER = 36


def engine_restart(with_broker: bool, workdir: Path) -> dict[str, Any]:
    """Start, store a 384-token prefix, SIGKILL the group, start again: the second start's
    wall time to its first token, and what it loaded from the host tier. The bench is the
    subreaper of what it starts: the killed server's workers become its children and are
    reaped by it, so their CPU is the bench's own, not the rest of the machine's."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    from tests.vllm.server import offloading_config, running_server, server_command

    prompt = [3 + (i * 7) % 1000 for i in range(384)] + [1000] * 16
    sock = str(workdir / "run" / "broker.sock")
    serve = None
    extra: dict[str, Any] = {}
    if with_broker:
        serve, _ = start_serve(96 << 20, sock, workdir / "serve.log")
        extra = {"hostpool_broker": sock, "hostpool_pool": "bench"}
    args = ["--kv-transfer-config", json.dumps(offloading_config(extra))]
    # vLLM's temporary files and ZMQ sockets (which a killed server leaves) in the workdir
    env = {"TMPDIR": str(workdir), "VLLM_RPC_BASE_PATH": str(workdir)}
    shm_before = set(os.listdir("/dev/shm"))
    try:
        with other_cpu() as load:
            with running_server(workdir, args, env=env) as first:
                first.complete(prompt, max_tokens=1)
                tree = first.processes()
                os.killpg(first.proc.pid, signal.SIGKILL)
                first.proc.wait()
                reap_orphaned({p.pid for p in tree} - {first.proc.pid})
            remove_unheld(set(os.listdir("/dev/shm")) - shm_before)
            started = time.monotonic()

            def timed(model_dir: Path, port: int) -> list[str]:
                nonlocal started
                started = time.monotonic()
                return server_command(model_dir, port, args)

            with running_server(workdir, command=timed, env=env) as second:
                second.complete(prompt, max_tokens=1)
                first_token_s = time.monotonic() - started
                metrics = second.metrics()
                second.stop()
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=600)
    hits = sum(
        float(m.group(1))
        for m in re.finditer(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$",
                             metrics, re.M)
    )  # fmt: skip
    return {
        "broker": with_broker,
        "restart_to_first_token_s": first_token_s,
        "prefix_tokens": 384,
        "prefix_tokens_from_host_tier": hits,
        "other_cpus": load["other_cpus"],
    }


def reap_orphaned(pids: set[int], timeout: float = 120.0) -> None:
    """Reap the killed server's workers, which its death made this subreaper's children
    (each once its own parent is gone): their CPU then counts as the bench's. A pid some
    other parent reaped is gone from /proc."""
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    pids.discard(pid)
            except ChildProcessError:  # not ours yet (its parent is dying), or reaped
                if not psutil.pid_exists(pid):
                    pids.discard(pid)
        if pids:
            time.sleep(0.05)  # a SIGKILLed tree exits within milliseconds: no event here
    if pids:
        raise RuntimeError(f"the killed server's processes {sorted(pids)} did not exit")


def remove_unheld(names: set[str]) -> list[str]:
    """vLLM's shared-memory message queues (`/dev/shm/psm_*`, 400 MiB for the tiny model)
    outlive a SIGKILL (nobody unlinks them): remove those of `names` that no process
    holds, proven by the kernel (a write lease is refused while any process has the file
    open or mapped), as `hostpool reap` does. Returns what was removed."""
    import fcntl

    removed = []
    for name in sorted(n for n in names if n.startswith("psm_")):
        path = f"/dev/shm/{name}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            os.unlink(path)
            removed.append(name)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass  # held by a live process: not the killed engine's
        finally:
            os.close(fd)
    return removed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=8 * GiB, help="default 8GiB")
    parser.add_argument("--rounds", type=int, default=5, help="lessee processes (default 5)")
    parser.add_argument("--engine", action="store_true", help="also the vLLM restarts")
    args = parser.parse_args()
    result: dict[str, Any] = {"attach_vs_populate": attach_vs_populate(args.size, args.rounds)}
    a = result["attach_vs_populate"]
    print(
        f"{format_size(args.size)}: populate {a['populate_s']:.3f} s; lease "
        f"{a['lease_s'] * 1000:.1f} ms = {a['lease_share_of_populate']:.2%} of it (target "
        f"<= 5%); lease and prefault {a['lease_and_prefault_s'] * 1000:.0f} ms = "
        f"{a['lease_and_prefault_share_of_populate']:.1%}; other processes "
        f"{a['other_cpus']:.2f} CPUs"
    )
    if args.engine:
        runs = []
        for with_broker in (True, False):
            with tempfile.TemporaryDirectory(prefix="hostpool-bench-engine-") as tmp:
                runs.append(engine_restart(with_broker, Path(tmp)))
                r = runs[-1]
                print(
                    f"engine restart {'with' if with_broker else 'without'} broker: first "
                    f"token {r['restart_to_first_token_s']:.1f} s after start, "
                    f"{r['prefix_tokens_from_host_tier']:.0f}/384 prefix tokens from the "
                    "host tier"
                )
        result["engine_restart"] = runs
    write_result(RESULTS, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
