"""The broker (`hostpool serve --share-socket`) lends its pools to real processes: a lease
is exclusive (the second is refused naming the holder's pid), a lessee killed with
SIGKILL ends its lease and the broker keeps the memory and what was written, only the
broker's uid may connect, and the leases and adoptions show on serve's /metrics and in
the lease ledger's plain data (/debug/pools: each lease with its lessee's pid)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from tests import helpers, waiting
from tests.test_serve import Served, start_serve

MiB = 1 << 20
CHUNK = 4 * MiB
POOL = 16 * MiB

# A lessee: leases `pool` (argv: path, pool, mode), prints one JSON line, then holds the
# lease until its stdin closes. `fill`: writes byte i+1 over chunk i of the pool and its pid
# at the end; `read`: reports the first byte of every chunk and the pid found at the end;
# `index`: leases only the index part (argv[4] bytes) and writes b"hello" at its start.
LESSEE = """
import ctypes, json, os, struct, sys
from hostpool.broker import lease
from hostpool.errors import ShareError
path, pool, mode = sys.argv[1:4]
try:
    if mode == "index":
        l = lease(path, pool, memory=False, index_bytes=int(sys.argv[4]))
        seen = bytes(l.index[:5])
        l.index[:5] = b"hello"
        out = {"pid": os.getpid(), "seen": seen.decode(errors="replace")}
    else:
        l = lease(path, pool)
        buf = l.buffer()
        chunk = l.sizes[0]
        if mode == "fill":
            for i in range(len(l.sizes)):
                ctypes.memset(l.address + i * chunk, i + 1, chunk)
            struct.pack_into("<q", buf, l.size - 8, os.getpid())
        firsts = [buf[i * chunk] for i in range(len(l.sizes))]
        (pid,) = struct.unpack_from("<q", buf, l.size - 8)
        del buf
        out = {"pid": os.getpid(), "size": l.size, "sizes": l.sizes, "firsts": firsts,
               "writer": pid, "fds": len(l.fds)}
except ShareError as exc:
    print(json.dumps({"pid": os.getpid(), "error": str(exc)}), flush=True)
    sys.exit(1)
print(json.dumps(out), flush=True)
sys.stdin.read()
l.close()
"""


class Lessee:
    """A real lessee process and the JSON line it printed (waited on: a pipe). With `uid`
    it is forked from this process after its imports and becomes that uid (a uid that may
    not read this checkout, under a 0700 directory, could not start an interpreter on it):
    it runs the same script."""

    def __init__(self, path: str, pool: str, mode: str, *extra: str, uid: int | None = None):
        argv = [path, pool, mode, *extra]
        if uid is None:
            self.proc: subprocess.Popen[str] | ForkedLessee = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(LESSEE), *argv],
                cwd=helpers.ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
        else:
            self.proc = ForkedLessee(argv, uid)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"lessee exited {self.proc.wait()} without a report"
        self.report = json.loads(line)

    def end(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=waiting.DEADLINE)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class ForkedLessee:
    """LESSEE run in a child forked from this process as `uid` (groups cleared, its gid
    the uid's number), with pipes for its stdin and stdout: what `Lessee` reads of a
    Popen."""

    def __init__(self, argv: list[str], uid: int) -> None:
        import hostpool.broker  # imported as root, before the fork
        import hostpool.errors  # noqa: F401

        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                helpers.enter_child({0, 1, 2}, uid)
                sys.stdin, sys.stdout = open(0), open(1, "w")  # noqa: SIM115
                sys.argv = ["lessee", *argv]
                try:
                    exec(compile(textwrap.dedent(LESSEE), "lessee", "exec"), {})
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        os.close(in_r)
        os.close(out_w)
        self.pid = pid
        self.stdin: Any = open(in_w, "w")  # noqa: SIM115
        self.stdout: Any = open(out_r)  # noqa: SIM115
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:  # its pidfd turns readable when it exits: the event
            pidfd = os.pidfd_open(self.pid)
            try:
                select.select([pidfd], [], [], timeout or waiting.DEADLINE)
            finally:
                os.close(pidfd)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("forked lessee", timeout or waiting.DEADLINE)
        self.stdout.close()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


def metric(served: Served, name: str, **labels: str) -> float | None:
    """A sample of serve's /metrics, None if it has none with exactly these labels."""
    body = served.get("/metrics")[1]
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", body, re.M)
    return None if match is None else float(match.group(1))


@pytest.fixture
def broker(tmp_path: os.PathLike[str]) -> Iterator[tuple[Served, str]]:
    config = os.path.join(tmp_path, "serve.toml")
    with open(config, "w") as f:
        f.write(f'[pools.kv]\nsize = "{POOL}"\nchunk = "{CHUNK}"\n[pools.meta]\nsize = "1MiB"\n')
    sock = os.path.join(tmp_path, "run", "broker.sock")
    served = start_serve(tmp_path, "--config", config, "--share-socket", sock)
    yield served, sock
    served.kill()


def test_a_lease_is_exclusive_and_outlives_its_lessee(broker: tuple[Served, str]) -> None:
    served, sock = broker
    assert metric(served, "hostpool_broker_leases", pool="kv") == 0
    started = [json.loads(x) for x in served.log().splitlines() if "hostpool.broker_started" in x]
    assert started and "every pool is new" in started[0]["cold"]  # a broker start is cold
    first = Lessee(sock, "kv", "fill")
    try:
        # the pool's four 4 MiB chunks, mapped side by side at one address
        assert first.report["sizes"] == [CHUNK] * 4 and first.report["size"] == POOL
        assert first.report["firsts"] == [1, 2, 3, 4]
        assert metric(served, "hostpool_broker_leases", pool="kv") == 1
        # the lease is in the ledger's plain data: /debug/pools names its lessee
        (held,) = pool_doc(served, "kv")["leases"]
        assert held["part"] == "memory" and held["pid"] == first.report["pid"], held
        assert held["uid"] == os.getuid() and held["since"].endswith("Z"), held
        assert pool_doc(served, "meta")["leases"] == []
        second = Lessee(sock, "kv", "read")
        assert second.proc.wait(timeout=waiting.DEADLINE) == 1
        error = second.report["error"]
        assert f"leased by pid {first.report['pid']}" in error, error
        assert "exclusive" in error
        allocated = metric(served, "hostpool_allocated_bytes", allocator="shm",
                            page_size="4KiB", pool="kv")  # fmt: skip
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        log = waiting.wait_for_log(
            served.stderr_path, "hostpool.broker_lease_ended", alive=served.proc
        )
        assert "connection closed" in log and f"{first.report['pid']}" in log
        assert metric(served, "hostpool_broker_leases", pool="kv") == 0
        assert pool_doc(served, "kv")["leases"] == []  # gone with its SIGKILLed lessee
        assert (
            metric(served, "hostpool_allocated_bytes", allocator="shm", page_size="4KiB", pool="kv")
            == allocated
            == POOL
        )
        third = Lessee(sock, "kv", "read")
        try:
            # what the killed lessee wrote is still there, read through a new lease
            assert third.report["firsts"] == [1, 2, 3, 4]
            assert third.report["writer"] == first.report["pid"]
        finally:
            assert third.end() == 0
        waiting.wait_for(
            lambda: metric(served, "hostpool_broker_leases", pool="kv") == 0,
            "the lease to end with its connection",
        )
    finally:
        first.kill()
    assert served.stop() == 0


def pool_doc(served: Served, pool: str) -> dict[str, Any]:
    """The pool's entry in serve's /debug/pools (its lease ledger's state included)."""
    status, body = served.get("/debug/pools")
    assert status == 200, body
    entry: dict[str, Any] = json.loads(body)["pools"][pool]
    return entry


def index_ended(served: Served, count: int) -> None:
    """Wait until the broker has ended `count` index leases (each lessee's connection
    close is seen by its loop, after the lessee process is gone)."""

    def ended() -> bool:
        lines = served.log().splitlines()
        return sum('"hostpool.broker_lease_ended"' in x and '"part": "index"' in x
                   for x in lines) >= count  # fmt: skip

    waiting.wait_for(ended, f"{count} index leases to end", alive=served.proc)


def test_the_index_part_is_leased_apart_and_adoptions_are_counted(
    broker: tuple[Served, str],
) -> None:
    served, sock = broker
    page = os.sysconf("SC_PAGE_SIZE")
    scheduler = Lessee(sock, "kv", "index", str(4 * page))
    try:
        assert scheduler.report["seen"] == "\0" * 5  # a fresh index
        worker = Lessee(sock, "kv", "fill")  # the memory part is another lease
        other = Lessee(sock, "kv", "index", str(4 * page))
        assert other.proc.wait(timeout=waiting.DEADLINE) == 1
        assert f"pid {scheduler.report['pid']}" in other.report["error"]
        assert metric(served, "hostpool_broker_leases", pool="kv") == 2
        leases = pool_doc(served, "kv")["leases"]
        parts = {(x["part"], x["pid"]) for x in leases}
        assert parts == {("memory", worker.report["pid"]), ("index", scheduler.report["pid"])}
        assert worker.end() == 0
    finally:
        scheduler.kill()
    index_ended(served, 1)  # the broker saw the killed lessee's connection close
    again = Lessee(sock, "kv", "index", str(4 * page))
    try:
        assert again.report["seen"] == "hello"  # the index outlived its lessee too
    finally:
        assert again.end() == 0
    index_ended(served, 2)
    # the adoption report of an index lessee reaches the broker's counters
    code = textwrap.dedent(f"""
        from hostpool.broker import lease
        with lease({sock!r}, "kv", memory=False, index_bytes={4 * page}) as l:
            l.report(7, {{"identity": 2, "unfinished": 1}}, reason="identity", field_="dtype")
        print("reported")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=helpers.ROOT, capture_output=True,
                          text=True, timeout=waiting.DEADLINE)  # fmt: skip
    assert done.returncode == 0 and "reported" in done.stdout, done.stderr
    assert metric(served, "hostpool_broker_adopted_blocks_total", pool="kv") == 7
    kv = pool_doc(served, "kv")  # the adoption is in the ledger's plain data too
    assert kv["adopted_blocks"] == 7
    assert kv["discarded_blocks"] == {"identity": 2, "unfinished": 1}
    assert pool_doc(served, "meta")["adopted_blocks"] == 0
    assert metric(served, "hostpool_broker_adopted_blocks_total", pool="meta") == 0
    assert (
        metric(served, "hostpool_broker_discarded_blocks_total", pool="kv", reason="identity") == 2
    )
    log = waiting.log_text(served.stderr_path)
    assert "hostpool.broker_adopted" in log and '"field": "dtype"' in log
    # an index of another size is a fresh one: nothing of the old one is handed out
    index_ended(served, 3)
    fresh = Lessee(sock, "kv", "index", str(8 * page))
    try:
        assert fresh.report["seen"] == "\0" * 5
    finally:
        assert fresh.end() == 0


def test_a_pool_the_broker_does_not_hold_is_refused_naming_its_pools(
    broker: tuple[Served, str],
) -> None:
    _, sock = broker
    lessee = Lessee(sock, "nope", "read")
    assert lessee.proc.wait(timeout=waiting.DEADLINE) == 1
    assert "no pool 'nope'" in lessee.report["error"] and "'kv'" in lessee.report["error"]


def test_only_the_brokers_uid_may_lease(public_dir: str) -> None:
    """A foreign uid (setpriv) reaches the socket (allowed_uids opens it to others) but
    SO_PEERCRED refuses it: the connection is closed, and the lease fails saying so."""
    import torch
    from structlog.testing import capture_logs

    from hostpool import HostPoolManager
    from hostpool.broker import Broker

    path = os.path.join(public_dir, "open", "broker.sock")
    with HostPoolManager() as manager:
        t = manager.allocator("kv").allocate((MiB,), torch.uint8)
        with Broker(manager, path, allowed_uids=[4242]) as broker, capture_logs() as logs:
            assert os.stat(path).st_mode & 0o777 == 0o666  # reachable, and checked
            lessee = Lessee(path, "kv", "read", uid=65534)
            assert lessee.proc.wait(timeout=waiting.DEADLINE) == 1
            assert "not allowed" in lessee.report["error"], lessee.report
            assert broker.book.leases() == {}
        refused = [e for e in logs if e["event"] == "hostpool.share_refused"]
        assert refused and refused[0]["uid"] == 65534
        del t


@pytest.fixture
def public_dir() -> Iterator[str]:
    with helpers.public_dir("hostpool-broker-") as top:
        yield top


def test_a_configured_group_may_lease_and_no_one_else(
    public_dir: str, tmp_path: os.PathLike[str]
) -> None:
    """`--share-group nogroup` (gid 65534, the primary group of uid 65534): uid 65534 leases
    the pool (a real process, setpriv), uid 4242 (in no such group) is refused by
    SO_PEERCRED, and an unknown group is a configuration error (exit 2) before anything is
    allocated."""
    import grp

    group = grp.getgrgid(65534).gr_name
    sock = os.path.join(public_dir, "run", "broker.sock")
    served = start_serve(tmp_path, "--pool", "kv=4MiB", "--share-socket", sock,
                         "--share-group", group)  # fmt: skip
    try:
        lessee = Lessee(sock, "kv", "fill", uid=65534)
        try:
            assert lessee.report["size"] == 4 * MiB and lessee.report["firsts"] == [1]
        finally:
            assert lessee.end() == 0
        refused = Lessee(sock, "kv", "read", uid=4242)
        assert refused.proc.wait(timeout=waiting.DEADLINE) == 1
        assert "not allowed" in refused.report["error"]
        assert '"uid": 4242' in served.log() and "uid not allowed" in served.log()
    finally:
        served.kill()
    bad = helpers.hostpool("serve", "--check", "--pool", "kv=1MiB", "--share-socket", sock,
                           "--share-group", "no-such-group-here")  # fmt: skip
    assert bad.returncode == 2 and "no group 'no-such-group-here'" in bad.stderr, bad.stderr


def test_bad_lease_requests_get_one_clear_refusal(tmp_path: os.PathLike[str]) -> None:
    """Raw requests to an in-process broker: each bad one is refused with its reason (or,
    malformed, costs only its own connection), and nothing is leased."""
    import socket

    import torch

    from hostpool import HostPoolManager
    from hostpool.broker import Broker, lease
    from hostpool.errors import ShareError
    from hostpool.serve.debugdoc import debug_document
    from hostpool.share import protocol

    path = os.path.join(tmp_path, "run", "broker.sock")
    page = os.sysconf("SC_PAGE_SIZE")

    def ask(message: dict[str, object]) -> dict[str, object] | None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(waiting.DEADLINE)
            s.connect(path)
            protocol.send(s, message)
            try:
                reply, fds, _ = protocol.receive(s, max_fds=4)
            except ConnectionError:
                return None  # malformed: the broker dropped this connection
            protocol.close_all(fds)
            return reply

    with HostPoolManager() as manager:
        t = manager.allocator("kv").allocate((MiB,), torch.uint8)
        with Broker(manager, path) as broker:
            refusals = {
                "index_bytes": ask(
                    {"op": "lease", "pool": "kv", "part": "index", "index_bytes": page + 1}
                ),
                "no pool": ask({"op": "lease", "pool": "nope", "part": "memory"}),
                "report": ask({"op": "lease_report", "pool": "kv", "adopted": 1, "discarded": {}}),
            }
            errors = {k: str((v or {}).get("error")) for k, v in refusals.items()}
            assert "whole pages" in errors["index_bytes"]
            assert "no pool 'nope'" in errors["no pool"]
            assert "does not lease the index" in errors["report"]
            assert ask({"op": "lease", "pool": "kv", "part": "everything"}) is None
            assert ask({"op": "lease_report", "pool": "kv"}) is None
            with lease(path, "kv", memory=False, index_bytes=page) as held:
                with pytest.raises(ShareError, match="reasons one of"):
                    held.report(1, {"because": 1})
                held.report(3, {"torn": 1})
                # the broker's book is the manager's lease ledger: /debug/pools reads it
                kv = debug_document(manager, 0.0)["pools"]["kv"]
                (entry,) = kv["leases"]
                assert (entry["part"], entry["pid"]) == ("index", os.getpid())
            assert broker.book is manager.leases
            assert broker.book.counters() == ({"kv": 3}, {("kv", "torn"): 1})
            assert kv["adopted_blocks"] == 3 and kv["discarded_blocks"] == {"torn": 1}
            waiting.wait_for(lambda: broker.book.leases() == {}, "the lease to end")
        del t


def test_a_forked_child_starts_with_an_empty_lease_ledger() -> None:
    """As the region ledger: the leases are the parent's connections, not the child's."""
    from hostpool.core.leases import LeaseBook

    book = LeaseBook()
    book.take("kv", "memory", peer=1, pid=4242, uid=0)
    book.count("kv", 5, {"torn": 1})

    def child() -> str:
        return repr(book.pools(["kv"])["kv"].to_dict())

    code, out = helpers.run_forked(child)
    assert code == 0, out
    assert out == repr({"leases": [], "adopted_blocks": 0, "discarded_blocks": {}})
    parent = book.pools(["kv"])["kv"]  # the parent's book is untouched
    assert [h.pid for h in parent.held] == [4242] and parent.adopted_blocks == 5
