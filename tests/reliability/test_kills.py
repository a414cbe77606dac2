"""SIGKILLs: of the server with peers attached, of a peer, of a worker mid-populate."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from hostpool.errors import ShareError
from hostpool.share import attach
from tests import helpers


def _serve(tmp: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    from tests.test_serve import start_serve

    served = start_serve(tmp, *args)
    return served.proc, served.url


def test_serve_killed_with_peers_attached(tmp_path: os.PathLike[str]) -> None:
    baseline = helpers.shmem_bytes()
    sock = os.path.join(tmp_path, "s", "serve.sock")
    proc, _ = _serve(os.fspath(tmp_path), "--pool", "kv=8MiB", "--share-socket", sock)
    deadline = time.monotonic() + 10
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.05)
    peer = attach(sock, "kv")
    peer.tensors[0][:4096].fill_(3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert int(peer.tensors[0][:4096].sum()) == 3 * 4096  # still mapped here
    with pytest.raises(ShareError):
        peer.list_pools()
    with pytest.raises((ConnectionError, ShareError, FileNotFoundError)):
        attach(sock, "kv")
    peer.close()
    deadline = time.monotonic() + 10
    while helpers.shmem_bytes() > baseline + (16 << 20) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert helpers.shmem_bytes() <= baseline + (16 << 20)


def test_peer_killed_server_keeps_serving(tmp_path: os.PathLike[str]) -> None:
    sock = os.path.join(tmp_path, "p", "serve.sock")
    proc, url = _serve(os.fspath(tmp_path), "--pool", "kv=4MiB", "--share-socket", sock)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        peer = helpers.attached_peer(sock, "kv")
        import urllib.request

        def attached() -> float:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith('hostpool_attached_clients{pool="kv"}'):
                        return float(line.split()[-1])
            return -1.0

        assert attached() == 1.0
        peer.kill()
        peer.wait()
        deadline = time.monotonic() + 10
        while attached() != 0.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert attached() == 0.0
        again = attach(sock, "kv")  # still serving
        assert again.tensors[0].numel() == 4 << 20
        again.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_worker_killed_mid_populate(tmp_path: os.PathLike[str]) -> None:
    baseline = helpers.shmem_bytes()
    before = set(os.listdir("/dev/shm"))
    code = """
import sys, torch
from hostpool import ShmHostTensorAllocator
print("go", flush=True)
for backend in ("memfd", "devshm"):
    ShmHostTensorAllocator("big", shm_backend=backend).allocate((2 << 30,), torch.uint8)
"""
    worker = helpers.python_child(code, ready="go", stdin=False)
    time.sleep(1.0)  # inside populate of the first 2 GiB
    worker.send_signal(signal.SIGKILL)
    assert worker.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while helpers.shmem_bytes() > baseline + (16 << 20) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert helpers.shmem_bytes() <= baseline + (16 << 20)
    assert set(os.listdir("/dev/shm")) == before  # the fallback file was unlinked at birth
