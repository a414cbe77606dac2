"""Zero-copy sharing with real peer processes: writes both ways, security, kills."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import signal
import socket
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostpool import HostPoolManager
from hostpool.errors import ShareError
from hostpool.share import PoolShareServer, attach, protocol
from tests import helpers, waiting
from tests.reliability.share_support import public_dir

__all__ = ["public_dir"]  # a fixture

MiB = 1 << 20


@pytest.fixture
def shared(tmp_path: os.PathLike[str]) -> Iterator[tuple[HostPoolManager, PoolShareServer, str]]:
    path = os.path.join(tmp_path, "share", "pool.sock")
    manager = HostPoolManager()
    server = PoolShareServer(manager, path).start()
    yield manager, server, path
    shared_tensor_keepalive.clear()
    server.close()
    manager.close()


def test_writes_cross_both_ways_and_only_the_manifest_travels(
    shared: tuple[HostPoolManager, PoolShareServer, str],
) -> None:
    manager, _server, path = shared
    t = manager.allocator("kv").allocate((16 * MiB // 4,), torch.float32)
    t[:1024].fill_(2.5)

    def peer() -> str:
        with attach(path, "kv") as h:
            (view,) = h.tensors
            seen = float(view[:1024].sum())
            view[1024:2048].fill_(7.0)
            return json.dumps({"seen": seen, "received": h.received_bytes, "n": view.numel()})

    code, out = helpers.run_forked(peer)
    assert code == 0, out
    result = json.loads(out)
    assert result["seen"] == 2560.0 and result["n"] == t.numel()
    assert result["received"] < 4096  # the manifest, not 16 MiB of pages
    assert float(t[1024:2048].sum()) == 7.0 * 1024
    del t


def test_attached_clients_counted_and_a_killed_peer_detached(
    shared: tuple[HostPoolManager, PoolShareServer, str],
) -> None:
    manager, server, path = shared
    t = manager.allocator("kv2").allocate((MiB,), torch.uint8)
    peer = helpers.attached_peer(path, "kv2")
    waiting.wait_for(lambda: server.attached_counts().get("kv2") == 1, "one peer on kv2")
    (record,) = [r for r in manager.snapshot() if r.pool == "kv2"]
    assert record.peers == 1
    peer.kill()
    peer.wait()
    waiting.wait_for(lambda: server.attached_counts().get("kv2") == 0, "no peer on kv2")
    # The server keeps serving others.
    code2, out = helpers.run_forked(lambda: attach(path, "kv2").tensors[0].numel())
    assert code2 == 0 and out == str(MiB)
    del t


def test_server_sigkill_leaves_peer_mapping_readable(tmp_path: os.PathLike[str]) -> None:
    baseline = helpers.shmem_bytes()
    path = os.path.join(tmp_path, "s", "srv.sock")
    server_code = f"""
import sys, torch
from hostpool import HostPoolManager
from hostpool.share import PoolShareServer
m = HostPoolManager()
t = m.allocator("kv").allocate((8 << 20,), torch.uint8)
t.fill_(9)
PoolShareServer(m, {path!r}).start()
print("ready", flush=True)
sys.stdin.read()
"""
    srv = helpers.python_child(server_code)
    h = attach(path, "kv")
    srv.send_signal(signal.SIGKILL)
    srv.wait()
    assert int(h.tensors[0][: 1 << 20].sum()) == 9 << 20  # still mapped, still readable
    with pytest.raises(ShareError, match="gone"):
        h.list_pools()
    h.close()
    waiting.wait_for(
        lambda: helpers.shmem_bytes() <= baseline + (16 << 20), "the shared memory given back"
    )


def test_unsealed_and_short_fds_are_refused(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "u", "pool.sock")
    with HostPoolManager() as manager, PoolShareServer(manager, path):
        t = manager.allocator("fallback", shm_backend="devshm").allocate((MiB,), torch.uint8)
        with pytest.raises(ShareError, match="not sealed"):
            attach(path, "fallback")
        h = attach(path, "fallback", allow_unsealed=True)
        assert h.tensors[0].numel() == MiB
        h.close()
        del t
    # A server that lies about the size: serve a real memfd smaller than its manifest.
    fake = os.path.join(tmp_path, "fake.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(fake)
    listener.listen(1)
    fd = os.memfd_create("liar", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)

    def liar() -> None:
        conn, _ = listener.accept()
        protocol.receive(conn)
        region = {
            "id": 1,
            "name": "liar",
            "dims": [MiB],
            "dtype": "torch.uint8",
            "bytes": MiB,
            "seals": 0,
        }
        protocol.send(conn, {"ok": True, "readonly": True, "regions": [region], "fd_packets": 1})
        protocol.send(conn, {"op": "fds", "index": 0}, [fd])
        conn.recv(1)  # until the client, having refused, hangs up
        conn.close()

    import threading

    th = threading.Thread(target=liar)
    th.start()
    with pytest.raises(ShareError, match="smaller than"):
        attach(fake, "x", allow_unsealed=True)
    th.join()
    os.close(fd)
    listener.close()


def test_peer_credentials_and_readonly_as_another_uid(public_dir: str) -> None:
    from structlog.testing import capture_logs

    path = os.path.join(public_dir, "open", "pool.sock")
    with HostPoolManager() as manager:
        t = manager.allocator("ro").allocate((MiB,), torch.uint8)
        t.fill_(5)
        with PoolShareServer(manager, path, allowed_uids=[4242]) as server, capture_logs() as logs:
            assert os.stat(path).st_mode & 0o777 == 0o666  # reachable, but checked
            code, out = helpers.run_forked(lambda: attach(path, "ro"), uid=65534)
            assert code == 1 and "ShareError" in out, out
        refused = [e for e in logs if e["event"] == "hostpool.share_refused"]
        assert refused and refused[0]["uid"] == 65534
        with PoolShareServer(manager, path, allowed_uids=[65534]) as server:

            def readonly_peer() -> str:
                h = attach(path, "ro", readonly=True)
                total = int(h.tensors[0].sum())
                # Find the fd we were given (the mapping keeps its own dup): reopen attempts.
                fds = [int(n) for n in os.listdir("/proc/self/fd")]
                results = []
                for fd in fds:
                    try:
                        target = os.readlink(f"/proc/self/fd/{fd}")
                    except OSError:
                        continue
                    if "hostpool.ro." not in target:
                        continue
                    try:
                        mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
                        results.append("mmap-rw-ok")
                    except PermissionError as e:
                        results.append(f"mmap:{e.errno}")
                    try:
                        os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
                        results.append("reopen-rw-ok")
                    except PermissionError as e:
                        results.append(f"reopen:{e.errno}")
                return json.dumps({"total": total, "results": results})

            code, out = helpers.run_forked(readonly_peer, uid=65534)
            assert code == 0, out
            result = json.loads(out)
            assert result["total"] == 5 * MiB
            assert result["results"] == [f"mmap:{errno.EACCES}", f"reopen:{errno.EACCES}"]
            del server
        del t


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    payload=st.one_of(
        st.binary(max_size=256),
        st.builds(
            lambda n, b: n.to_bytes(4, "big") + b, st.integers(0, 2**32 - 1), st.binary(max_size=64)
        ),
        st.builds(
            lambda d: protocol.encode(d)[: len(protocol.encode(d)) // 2],
            st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
        ),
        st.builds(
            lambda op, pool: protocol.encode({"op": op, "pool": pool}),
            st.sampled_from(["attach", "detach", "list", "boom", ""]),
            st.one_of(st.integers(), st.text(max_size=8), st.none()),
        ),
    ),
    with_fd=st.booleans(),
)
def test_malformed_traffic_never_stops_the_server(
    shared: tuple[HostPoolManager, PoolShareServer, str], payload: bytes, with_fd: bool
) -> None:
    manager, _server, path = shared
    if manager.allocator_for("fuzz") is None:
        # kept for the whole test: every example attaches to it
        shared_tensor_keepalive.append(manager.allocator("fuzz").allocate((4096,), torch.uint8))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(path)
    try:
        if with_fd:
            r, w = os.pipe()
            s.sendmsg(
                [payload or b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, r.to_bytes(4, "little"))]
            )
            os.close(r)
            os.close(w)
        else:
            s.send(payload or b"\0")
        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
            s.recv(65536)
    finally:
        s.close()
    # ... and a well-behaved peer is still served.
    h = attach(path, "fuzz")
    assert h.tensors[0].numel() == 4096
    h.close()


shared_tensor_keepalive: list[object] = []


@pytest.mark.parametrize(
    "body",
    [b"[" * 5000 + b"]" * 5000, b'{"v":2,"ok":' + b"9" * 5000 + b"}", b'{"v":2,"ok":\xff}'],
    ids=["nested", "huge-integer", "bad-utf8"],
)
def test_malformed_packets_are_protocol_errors(body: bytes) -> None:
    # json raises RecursionError and a plain ValueError for these, not JSONDecodeError.
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(len(body).to_bytes(4, "big") + body)


@pytest.mark.parametrize(
    "limits",
    [{"max_connections": 0}, {"max_connections_per_uid": -1}, {"request_timeout": 0}],
)
def test_nonsensical_limits_are_config_errors(
    tmp_path: os.PathLike[str], limits: dict[str, float]
) -> None:
    from hostpool.errors import ConfigError

    path = os.path.join(tmp_path, "s", "pool.sock")
    with HostPoolManager() as manager, pytest.raises(ConfigError, match="must be positive"):
        PoolShareServer(manager, path, **limits)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []  # refused before anything was created
