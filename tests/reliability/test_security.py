"""Security properties: the /dev/shm fallback, socket modes, foreign uids, unsealed fds."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from hostpool import HostPoolManager, ShmHostTensorAllocator
from hostpool.memory import shm
from hostpool.share import PoolShareServer


def test_precreated_file_of_the_same_name_is_never_opened(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    names = iter(["taken", "fresh"])
    monkeypatch.setattr(shm, "random_suffix", lambda: next(names))
    seq = next(shm._sequence) + 1
    planted = os.path.join(tmp_path, f"hostpool.pre.{os.getpid()}.{seq}.taken")
    with open(planted, "w") as f:
        f.write("someone else's data")
    alloc = ShmHostTensorAllocator("pre", shm_backend="devshm", fallback_dir=os.fspath(tmp_path))
    t = alloc.allocate((8192,), torch.uint8)
    t.fill_(0xFF)
    with open(planted) as f:
        assert f.read() == "someone else's data"  # not truncated, not written
    assert os.listdir(tmp_path) == [os.path.basename(planted)]  # ours was unlinked at once
    alloc.close()
    del t


def test_default_socket_is_private(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "private", "pool.sock")
    with HostPoolManager() as manager, PoolShareServer(manager, path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert not os.path.exists(path)


def test_socket_path_that_is_not_a_socket_is_not_replaced(tmp_path: os.PathLike[str]) -> None:
    from hostpool.errors import ConfigError

    directory = os.path.join(tmp_path, "d")
    os.mkdir(directory, 0o700)
    path = os.path.join(directory, "pool.sock")
    with open(path, "w") as f:
        f.write("not a socket")
    with HostPoolManager() as manager, pytest.raises(ConfigError):
        PoolShareServer(manager, path).start()
    with open(path) as f:
        assert f.read() == "not a socket"


def test_memfd_is_0600_so_readonly_peers_cannot_reopen_it_writable() -> None:
    alloc = ShmHostTensorAllocator("mode")
    t = alloc.allocate((4096,), torch.uint8)
    assert stat.S_IMODE(os.fstat(alloc.fd).st_mode) == 0o600
    alloc.close()
    del t


# The foreign-uid (SO_PEERCRED), read-only-as-uid-65534 and never-sealed-fd cases run
# against real peers in tests/test_share.py; the planted symlink in test_memory_shm.py.
