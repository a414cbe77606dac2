"""`attach()` on a socket that is not there names the path (issue 18, point 9)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hostpool.errors import ShareError
from hostpool.share import attach


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
