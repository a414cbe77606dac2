"""SIGKILLs: of the server with peers attached, of a peer, of a worker mid-populate.

Each waits for the state it needs (the server's serving line, the worker's memfd gaining
pages, the peer count on /metrics), never for a time, and checks that the memory went by
name (no process holds or maps the victim's memfds), never by the host's Shmem, which
every other process on the machine moves.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from hostpool.errors import ShareError
from hostpool.share import attach
from tests import helpers, waiting


def _serve(tmp: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    from tests.test_serve import start_serve

    served = start_serve(tmp, *args)
    return served.proc, served.url


def test_serve_killed_with_peers_attached(tmp_path: os.PathLike[str]) -> None:
    sock = os.path.join(tmp_path, "s", "serve.sock")
    proc, _ = _serve(os.fspath(tmp_path), "--pool", "kv=8MiB", "--share-socket", sock)
    assert os.path.exists(sock)  # bound before `serving` is logged
    peer = attach(sock, "kv")
    peer.tensors[0][:4096].fill_(3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert int(peer.tensors[0][:4096].sum()) == 3 * 4096  # still mapped here
    with pytest.raises(ShareError):
        peer.list_pools()
    with pytest.raises((ConnectionError, ShareError, FileNotFoundError)):
        attach(sock, "kv")
    assert waiting.shm_holders(f"hostpool.kv.{proc.pid}.") == [os.getpid()]  # the peer's
    peer.close()
    assert waiting.shm_holders(f"hostpool.kv.{proc.pid}.") == []  # gone with the last map


def test_peer_killed_server_keeps_serving(tmp_path: os.PathLike[str]) -> None:
    sock = os.path.join(tmp_path, "p", "serve.sock")
    proc, url = _serve(os.fspath(tmp_path), "--pool", "kv=4MiB", "--share-socket", sock)
    try:
        assert os.path.exists(sock)  # bound before `serving` is logged
        peer = helpers.attached_peer(sock, "kv")
        import urllib.request

        def attached() -> float:
            with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith('hostpool_attached_clients{pool="kv"}'):
                        return float(line.split()[-1])
            return -1.0

        assert attached() == 1.0
        peer.kill()
        peer.wait()
        # the server notices the peer's socket close on its own schedule: wait for it
        waiting.wait_for(lambda: attached() == 0.0, "attached_clients back to 0", alive=proc)
        again = attach(sock, "kv")  # still serving
        assert again.tensors[0].numel() == 4 << 20
        again.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=waiting.DEADLINE) == 0


def test_worker_killed_mid_populate(tmp_path: os.PathLike[str]) -> None:
    code = """
import sys, torch
from hostpool import ShmHostTensorAllocator
print("go", flush=True)
for backend in ("memfd", "devshm"):
    ShmHostTensorAllocator("big", shm_backend=backend).allocate((2 << 30,), torch.uint8)
"""
    worker = helpers.python_child(code, ready="go", stdin=False)
    name = f"hostpool.big.{worker.pid}."
    try:
        # inside populate of the first 2 GiB: its memfd holds some pages, not all
        waiting.wait_for(
            lambda: 0 < (waiting.shm_fd_blocks(worker.pid, name) or 0) < 2 << 30 or None,
            "the worker's populate under way",
            alive=worker,
        )
    finally:
        worker.send_signal(signal.SIGKILL)
        assert worker.wait() == -signal.SIGKILL
    assert waiting.shm_holders(name) == []  # its memory went with it
    # the fallback file, if it was reached, was unlinked at birth
    assert [n for n in os.listdir("/dev/shm") if n.startswith(name)] == []
