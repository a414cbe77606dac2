"""Attribution by holder, not by name: a memfd named `hostpool.kv<tag>.<serve pid>.N` by
another uid (or by a process the serve's pid does not hold it for) counts in no pool and
does not keep `hostpool_exporter_processes` up; it is counted by reason in
`hostpool_exporter_ignored_objects`. The serve's own holders count, whatever their uid:
a forked worker (its mapping only) and a process of another uid it handed the fd to (as
a share client of another uid receives it)."""

from __future__ import annotations

import mmap
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from hostpool.proc import owners, procgroup, scan
from tests import helpers
from tests.exporting import Samples, running_exporter, scrape, value
from tests.reliability.results import record_procfs_attack as record
from tests.reliability.share_support import Held, public_dir

__all__ = ["public_dir"]  # a fixture

MiB = 1 << 20
PAGE = mmap.PAGESIZE
OTHER_UID = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

# the "serve": 1 MiB written into its pool's memfd, mapped; a worker forked with the
# mapping (its fds closed), and a process of uid 65534 it hands the fd to
SERVE = """
import mmap, os, subprocess, sys
fd = os.memfd_create(f"{sys.argv[1]}.{os.getpid()}.0")
os.pwrite(fd, b"x" * (1 << 20), 0)
mm = mmap.mmap(fd, 1 << 20)
r, w = os.pipe()
worker = os.fork()
if worker == 0:
    os.closerange(3, r)
    os.closerange(r + 1, 1 << 16)
    os.read(r, 1)  # until the serve closes its end
    os._exit(0)
os.close(r)
receiver = subprocess.Popen(
    sys.argv[2:] + [sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=[fd],
)
receiver.stdout.readline()  # it runs as its uid, holding the fd
print("ready", worker, receiver.pid, flush=True)
sys.stdin.read()
receiver.kill()
receiver.wait()
os.close(w)
os.waitpid(worker, 0)
"""

# holds a mapped memfd of 8 MiB (written) per name given (`PID`: its own pid)
FORGER = """
import mmap, os, sys
keep = []
for name in sys.argv[1:]:
    fd = os.memfd_create(name.replace("PID", str(os.getpid())))
    os.pwrite(fd, b"y" * (8 << 20), 0)
    keep.append((fd, mmap.mmap(fd, 8 << 20)))
print("ready", flush=True)
sys.stdin.read()
"""


@dataclass
class Serve:
    pool: str
    prefix: str  # the pool's name up to the pid: `hostpool.<pool>`
    proc: subprocess.Popen[str]
    worker: int
    receiver: int


def _start(argv: list[str]) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    assert words[:1] == ["ready"], words
    return proc, words[1:]


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.communicate(timeout=60)  # closes stdin (the child's cue) and drains its stdout


@pytest.fixture
def serve() -> Iterator[Serve]:
    pool = f"kv{secrets.token_hex(3)}"
    prefix = f"hostpool.{pool}"
    proc, (worker, receiver) = _start([sys.executable, "-c", SERVE, prefix, *OTHER_UID, "--"])
    try:
        assert os.stat(f"/proc/{receiver}").st_uid == 65534
        yield Serve(pool, prefix, proc, int(worker), int(receiver))
    finally:
        _stop(proc)


def forger(*names: str, uid: bool = True) -> subprocess.Popen[str]:
    proc, _ = _start([*(OTHER_UID if uid else []), sys.executable, "-c", FORGER, *names])
    return proc


def _gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not os.path.exists(f"/proc/{proc.pid}")
    return proc.pid


def ignored(samples: Samples, prefix: str) -> dict[str, float]:
    return {
        reason: value(samples, "hostpool_exporter_ignored_objects", prefix=prefix, reason=reason)
        for reason in owners.REASONS
    }


def test_a_name_forged_by_another_uid_counts_in_no_pool(serve: Serve) -> None:
    p = serve.prefix
    # uid 65534 names memfds after the serve's pid, after a pid no process has; root names
    # one after the serve's pid too: none is an object the serve holds
    evil = forger(f"{p}.{serve.proc.pid}.0", f"{p}.{serve.proc.pid}.7", f"{p}.{_gone_pid()}.1")
    evil_root = forger(f"{p}.{serve.proc.pid}.9", uid=False)
    try:
        assert os.stat(f"/proc/{evil.pid}").st_uid == 65534
        with running_exporter("--match", p) as exporter:
            _, samples = scrape(exporter.url)
            exporter.stop()
    finally:
        _stop(evil)
        _stop(evil_root)
    labels = {"prefix": p, "pool": serve.pool}
    # the serve (fd + mmap's dup, mapped) + its forked worker (mapped, no fd) + the
    # receiver of uid 65534 (the fd): 3 fds, 2 mappings, 1 MiB each time it is mapped
    assert value(samples, "hostpool_exporter_open_fds", **labels) == 3
    assert value(samples, "hostpool_exporter_mappings", **labels) == 2
    assert value(samples, "hostpool_exporter_mapped_bytes", **labels) == 2 * MiB
    assert value(samples, "hostpool_exporter_resident_bytes", **labels) == 2 * MiB  # not +32
    assert value(samples, "hostpool_exporter_processes", prefix=p) == 3  # not 5
    assert ignored(samples, p) == {
        "owner_gone": 1,
        "not_held_by_owner": 3,
        "owner_other_uid": 0,
        "unverified": 0,
    }
    record(
        "attribution",
        forged_objects=4,
        forged_bytes=32 * MiB,
        attacker_uid=65534,
        holders_counted=3,
        ignored={r: int(n) for r, n in ignored(samples, p).items() if n},
    )


def test_forged_names_alone_do_not_keep_processes_up(serve: Serve) -> None:
    """A pool of a live process that holds none of it: only a forger's objects."""
    p = f"hostpool.empty{secrets.token_hex(3)}"
    evil = forger(f"{p}.{serve.proc.pid}.0", f"{p}.{serve.worker}.0")
    try:
        with running_exporter("--match", p) as exporter:
            _, samples = scrape(exporter.url)
            exporter.stop()
    finally:
        _stop(evil)
    assert value(samples, "hostpool_exporter_processes", prefix=p) == 0
    assert not [k for k in samples if k[0] == "hostpool_exporter_open_fds"]
    assert ignored(samples, p)["not_held_by_owner"] == 2


@pytest.mark.parametrize("who", ["forger", "worker", "receiver"])
def test_pid_mode_checks_the_owner_too(serve: Serve, who: str) -> None:
    p = serve.prefix
    evil = forger(f"{p}.{serve.proc.pid}.0")
    try:
        pid = {"forger": evil.pid, "worker": serve.worker, "receiver": serve.receiver}[who]
        with running_exporter("--pid", str(pid)) as exporter:
            _, samples = scrape(exporter.url)
            exporter.stop()
    finally:
        _stop(evil)
    fds = {dict(k[1])["pool"]: v for k in samples if k[0] == "hostpool_exporter_open_fds"
           for v in [samples[k]]}  # fmt: skip
    if who == "forger":
        assert fds == {}
        assert ignored(samples, "hostpool.")["not_held_by_owner"] == 1  # --pid: every prefix
    else:  # the serve's own object, held by its worker (mapping) or its receiver (fd)
        labels = {"prefix": "hostpool.", "pool": serve.pool}
        # the worker's mapping holds the object's pages, as its owner's fd measured them
        # (it never touched them itself); the receiver holds an fd and maps nothing
        for name in ("mapped_bytes", "resident_bytes"):
            got = value(samples, f"hostpool_exporter_{name}", **labels)
            assert got == (MiB if who == "worker" else 0)
        assert fds == {serve.pool: 0 if who == "worker" else 1}
        assert sum(ignored(samples, "hostpool.").values()) == 0


def test_a_scan_that_cannot_read_the_owner_goes_by_uid(serve: Serve) -> None:
    """Run as uid 65534, the scan may not read the (root) serve: an object named after it
    counts only for holders of the serve's uid, so the forger's and the receiver's (both
    uid 65534) are `owner_other_uid`; the forger's object named after itself counts."""
    p = serve.prefix
    evil = forger(f"{p}.{serve.proc.pid}.0", f"{p}.PID.1")

    def scan_as_nobody() -> str:
        result = procgroup.scan_totals(scan.Matcher((p,)))
        pools = {pid: {pool: t.open_fds for pool, t in pp.items()} for pid, pp in result.processes}
        return repr((result.ignored, pools))

    try:
        code, out = helpers.run_forked(scan_as_nobody, uid=65534)
    finally:
        _stop(evil)
    assert code == 0, out
    assert out == repr(({(p, "owner_other_uid"): 2}, {evil.pid: {(p, serve.pool): 2}}))


def test_share_clients_of_another_uid_count_in_the_servers_pool(public_dir: str) -> None:
    """hostpool's own share: the server (this process) allocates, a uid-65534 client
    attaches read-only (a reopening of the same inode) and holds it; a forger of the same
    uid names a memfd after the server's pool. The client counts, the forger does not."""
    import torch

    from hostpool import HostPoolManager
    from hostpool.share import PoolShareServer, attach

    pool = f"sh{secrets.token_hex(3)}"
    p = f"hostpool.{pool}"
    path = os.path.join(public_dir, "s", "pool.sock")
    with HostPoolManager() as manager:
        t = manager.allocator(pool).allocate((MiB,), torch.uint8)
        t.fill_(1)
        with PoolShareServer(manager, path, allowed_uids=[65534]):

            def client() -> int:
                handle = attach(path, pool, readonly=True)
                keep.append(handle)
                return int(handle.tensors[0].sum())

            keep: list[object] = []
            peer = Held(client, uid=65534)
            evil = forger(f"{p}.{os.getpid()}.99")
            try:
                assert peer.result == MiB
                with running_exporter("--match", p) as exporter:
                    _, samples = scrape(exporter.url)
                    exporter.stop()
            finally:
                _stop(evil)
                assert peer.end() == 0
        del t
    labels = {"prefix": p, "pool": pool}
    assert value(samples, "hostpool_exporter_processes", prefix=p) == 2  # server + client
    # the server's mapping; the client's: the one it attached, and the server's it
    # inherited when forked (this test's way of making a process of another uid)
    assert value(samples, "hostpool_exporter_mapped_bytes", **labels) == 3 * MiB
    # the object's pages once per process that holds it: not the forger's 8 MiB
    assert value(samples, "hostpool_exporter_resident_bytes", **labels) == 2 * MiB
    assert ignored(samples, p)["not_held_by_owner"] == 1
