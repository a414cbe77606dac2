"""`attach()` on a socket that is not there names the path (issue 18, point 9), and every
failure that is not a bad argument is a ShareError, as documented (issue 26, point 7)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from hostpool.errors import ShareError
from hostpool.share import attach, protocol


def test_missing_socket_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.sock"
    with pytest.raises(ShareError, match=f"cannot attach to {path}: No such file"):
        attach(str(path), "kv")


def test_stale_socket_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(path))  # bound, never listening: what a crashed server leaves
    with pytest.raises(ShareError, match=f"cannot attach to {path}: Connection refused"):
        attach(str(path), "kv")


def _one_shot_server(path: Path, replies: list[dict[str, object]]) -> threading.Thread:
    """A raw server that answers one request with `replies`, then hangs up."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                protocol.receive(conn)
                for reply in replies:
                    protocol.send(conn, reply)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


HEAD = {"ok": True, "readonly": True, "reason": None, "fd_packets": 1,
        "regions": [{"bytes": 4096, "dims": [4096], "dtype": "torch.uint8"}]}  # fmt: skip


@pytest.mark.parametrize(
    "replies", [[], [HEAD], [{"pools": []}]], ids=["no-reply", "manifest-only", "not-a-manifest"]
)
def test_a_server_hanging_up_is_a_share_error(
    tmp_path: Path, replies: list[dict[str, object]]
) -> None:
    """attach() documents ShareError for everything that is not a bad argument: a server
    gone mid-attach is one, never a bare ConnectionError."""
    path = tmp_path / "gone.sock"
    thread = _one_shot_server(path, replies)
    try:
        with pytest.raises(ShareError) as caught:
            attach(str(path), "kv", timeout=30)
        assert not isinstance(caught.value, ConnectionError)
    finally:
        thread.join()


def test_list_pools_on_a_closed_attachment_is_a_share_error(tmp_path: Path) -> None:
    import torch

    from hostpool import HostPoolManager
    from hostpool.share import PoolShareServer

    path = str(tmp_path / "s" / "pool.sock")
    with HostPoolManager() as manager, PoolShareServer(manager, path):
        t = manager.allocator("kv").allocate((4096,), torch.uint8)
        h = attach(path, "kv", timeout=30)
        assert [p["pool"] for p in h.list_pools()] == ["kv"]
        h.close()
        with pytest.raises(ShareError, match="closed"):
            h.list_pools()
        del t
