"""Orphans on hugetlbfs hold hugepages, which nothing else gives back: `hostpool reap`
removes them as it does tmpfs files (the kernel grants a write lease on hugetlbfs too,
and refuses it while a process maps the file), and keeps the ones a process maps.

A private hugetlbfs in an `unshare -m` namespace, kept alive by a sleeper: the files die
with it, and nr_hugepages is restored by the `hugepages_2m` fixture."""

from __future__ import annotations

import json
import mmap
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import hostobjects
from tests.test_reap import hostpool

HUGEPAGE = 2 << 20
# maps its file (the fd closed), says ready, and sleeps: a holder /proc and the lease see
MAPPER = f"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, {HUGEPAGE})
os.close(fd)
m[0] = 1
print("ready", flush=True)
sys.stdin.read()
"""


@contextmanager
def private_hugetlbfs(mountpoint: Path) -> Iterator[str]:
    """A hugetlbfs of 2 MiB pages mounted on `mountpoint` in a namespace of its own; the
    path this process reaches it by."""
    mount = f"mount -t hugetlbfs -o pagesize=2M hostpool-reaptest {mountpoint}"
    script = f"{mount} && echo ready && exec sleep 600"
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    with hostobjects.ready_sleeper(argv) as proc:
        yield f"/proc/{proc.pid}/root{mountpoint}"


def _plant(path: str) -> None:
    """One hugepage written through a mapping, then left: an orphan of 2 MiB."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, HUGEPAGE)
        with mmap.mmap(fd, HUGEPAGE) as m:
            m[0] = 1
    finally:
        os.close(fd)


@contextmanager
def mapped_by_child(path: str) -> Iterator[None]:
    """A child process maps `path` (its fd closed) for the duration."""
    argv = [sys.executable, "-c", MAPPER, path]
    with hostobjects.ready_sleeper(argv, stdin=subprocess.PIPE):
        yield


def _free_hugepages() -> int:
    return int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())


def test_a_hugetlbfs_orphan_is_reaped_and_a_mapped_file_kept(
    hugepages_2m: int, tmp_path: Path
) -> None:
    (tmp_path / "huge").mkdir()
    with private_hugetlbfs(tmp_path / "huge") as huge:
        tag = secrets.token_hex(6)
        orphan, mapped = f"vllm_offload_{tag}.mmap", f"vllm_offload_{tag}m.mmap"
        _plant(f"{huge}/{orphan}")
        _plant(f"{huge}/{mapped}")
        with mapped_by_child(f"{huge}/{mapped}"):
            free_before = _free_hugepages()
            out = hostpool("reap", "--json", "--yes", "--min-age", "0", "--dir", huge,
                           "--engine", "vllm")  # fmt: skip
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            outcomes = {o["name"].rpartition("/")[2]: o for o in doc["objects"]}
            assert outcomes[orphan]["outcome"] == "removed", outcomes
            assert outcomes[orphan]["area"] == "hugetlbfs"
            assert outcomes[orphan]["freed_bytes"] == HUGEPAGE
            assert not os.path.exists(f"{huge}/{orphan}")
            # the mapped one is no orphan to the scan: not even a candidate
            assert mapped not in outcomes
            assert os.path.exists(f"{huge}/{mapped}")
            assert _free_hugepages() == free_before + 1  # the orphan's page came back


def test_the_lease_refuses_a_mapped_hugetlbfs_file(hugepages_2m: int, tmp_path: Path) -> None:
    """What reap relies on, on hugetlbfs: the write lease is refused while a process maps
    the file (its fd closed), and granted once it is gone."""
    from hostpool.host import lease

    (tmp_path / "huge").mkdir()
    with private_hugetlbfs(tmp_path / "huge") as huge:
        name = f"vllm_offload_{secrets.token_hex(6)}.mmap"
        _plant(f"{huge}/{name}")
        dfd = os.open(huge, os.O_PATH | os.O_DIRECTORY)
        try:
            before = lease.seen(os.stat(name, dir_fd=dfd, follow_symlinks=False))
            with mapped_by_child(f"{huge}/{name}"), pytest.raises(lease.Kept) as kept:
                lease.unlink_unheld(dfd, name, before)
            assert kept.value.outcome == "kept_held", kept.value.detail
            now = lease.seen(os.stat(name, dir_fd=dfd, follow_symlinks=False))
            assert lease.unlink_unheld(dfd, name, now).freed_bytes == HUGEPAGE
        finally:
            os.close(dfd)
