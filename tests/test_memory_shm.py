"""The shm backend against the real kernel: names, seals, modes, the /dev/shm fallback."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

import pytest
import torch

from hostpool import AllocationError, ShmHostTensorAllocator, alloc_shm
from hostpool.memory import shm
from tests import helpers


def test_memfd_is_named_sealed_and_private(no_leaked_fds: None) -> None:
    alloc = ShmHostTensorAllocator("kv")
    t = alloc.allocate((3, 1000), torch.float32)
    fd = alloc.fd
    assert fd is not None
    link = os.readlink(f"/proc/self/fd/{fd}")
    region = alloc.regions[0]
    assert (
        link == f"/memfd:hostpool.kv.{os.getpid()}.{region.facts.name.rsplit('.', 1)[1]} (deleted)"
    )
    assert region.facts.name is not None and region.facts.name.startswith(
        f"hostpool.kv.{os.getpid()}."
    )
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    for seal in (fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SEAL):
        assert seals & seal
    with pytest.raises(OSError) as exc:
        os.ftruncate(fd, 1 << 20)
    assert exc.value.errno == errno.EPERM
    assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    # page-rounded, and the tensor writes through to the memfd
    assert os.fstat(fd).st_size == 12288
    t[2, 999] = 7.5
    assert os.pread(fd, 4, 4 * 2999) == torch.tensor([7.5]).numpy().tobytes()
    alloc.close()
    del t


def test_alloc_shm_hands_out_an_owned_dup(no_leaked_fds: None) -> None:
    tensor, fd, mm = alloc_shm((4, 256), torch.float32, pool="compat")
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:hostpool.compat.")
    tensor.fill_(1.0)
    mm.close()  # safe while the tensor lives: nothing is unmapped under it
    assert float(tensor.sum()) == 1024.0
    os.close(fd)
    del tensor, mm


def test_devshm_fallback_is_private_and_unlinked(tmp_path: object, no_leaked_fds: None) -> None:
    before = set(os.listdir("/dev/shm"))
    alloc = ShmHostTensorAllocator("fb", shm_backend="devshm")
    t = alloc.allocate((1024,), torch.uint8)
    fd = alloc.fd
    assert fd is not None
    link = os.readlink(f"/proc/self/fd/{fd}")
    assert link.startswith("/dev/shm/hostpool.fb.") and link.endswith(" (deleted)")
    assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    assert set(os.listdir("/dev/shm")) == before
    assert alloc.regions[0].facts.seals == 0  # tmpfs files cannot be sealed; the Region says so
    alloc.close()
    del t


def test_planted_symlink_is_never_followed(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    victim = os.path.join(tmp_path, "victim")
    with open(victim, "w") as f:
        f.write("precious")
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(shm, "random_suffix", lambda: next(names))
    seq = next(shm._sequence) + 1
    predicted = f"hostpool.sym.{os.getpid()}.{seq}.planted"
    os.symlink(victim, os.path.join(tmp_path, predicted))
    alloc = ShmHostTensorAllocator("sym", shm_backend="devshm", fallback_dir=os.fspath(tmp_path))
    t = alloc.allocate((4096,), torch.uint8)
    t.fill_(1)
    assert alloc.regions[0].facts.name == f"hostpool.sym.{os.getpid()}.{seq}.fresh"
    with open(victim) as f:
        assert f.read() == "precious"
    assert os.path.islink(os.path.join(tmp_path, predicted))
    alloc.close()
    del t


def test_every_name_taken_raises_after_n_attempts(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    monkeypatch.setattr(shm, "random_suffix", lambda: "same")
    seq = next(shm._sequence) + 1
    os.symlink("/etc/passwd", os.path.join(tmp_path, f"hostpool.c.{os.getpid()}.{seq}.same"))
    alloc = ShmHostTensorAllocator("c", shm_backend="devshm", fallback_dir=os.fspath(tmp_path))
    with pytest.raises(AllocationError, match="16 attempts"):
        alloc.allocate((4096,), torch.uint8)
    assert os.listdir(tmp_path) == [f"hostpool.c.{os.getpid()}.{seq}.same"]


def test_memfd_unavailable_falls_back_to_devshm(
    monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    helpers.no_memfd(monkeypatch)
    alloc = ShmHostTensorAllocator("nomemfd")
    t = alloc.allocate((8192,), torch.uint8)
    assert alloc.regions[0].facts.backend == "devshm"
    assert os.readlink(f"/proc/self/fd/{alloc.fd}").startswith("/dev/shm/hostpool.nomemfd.")
    alloc.close()
    del t


def test_tiny_tmpfs_fails_cleanly_in_a_subprocess(root: None, tmp_path: os.PathLike[str]) -> None:
    """Populate past a 1 MiB tmpfs is an AllocationError, never a SIGBUS, and leaves nothing."""
    mnt = os.path.join(tmp_path, "tiny")
    os.mkdir(mnt)
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt}") != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        for populate in ("auto", "touch", "map_populate"):
            proc = helpers.run_python(
                f"""
                import os, torch
                from hostpool import ShmHostTensorAllocator, AllocationError
                from tests import helpers
                a = ShmHostTensorAllocator("tiny", shm_backend="devshm", fallback_dir={mnt!r},
                                           populate={populate!r})
                try:
                    a.allocate((8 << 20,), torch.uint8)
                except AllocationError as e:
                    print("refused", e.reason, e)
                assert helpers.fd_links() == {{}}, helpers.fd_links()
                assert helpers.maps_lines("hostpool.") == []
                assert os.listdir({mnt!r}) == []
                print("clean")
                """,
                cwd=os.path.dirname(os.path.dirname(__file__)),
            )
            assert proc.returncode == 0, (populate, proc.returncode, proc.stderr)
            assert "refused" in proc.stdout and "clean" in proc.stdout, proc.stdout
            assert ("no_space" in proc.stdout) or ("no_memory" in proc.stdout)
    finally:
        os.system(f"umount {mnt}")
