"""Issue 26.10 and 26.12: a malicious or squatting server cannot kill a client.

Any process that binds the socket path first is a server to `attach()`. Each test here
runs a raw server (not hostpool's) that sends crafted manifests and fds, and checks that
the client refuses with a ShareError that has the figures, before mapping anything, and
leaves no fd and no mapping behind:

- a server of another uid (a real setuid child): refused unless in `server_uids`;
- more bytes than `max_bytes`, and a sparse 4 GiB memfd with `prefault=True` inside a
  real 1 GiB memory cgroup (where today's client is OOM-killed);
- a hugetlb memfd from a server it does not trust (not this uid or root): its owner can
  punch holes and take the hugepages, SIGBUS-ing the client; unless sealed against
  punching (F_SEAL_FUTURE_WRITE);
- an fd sealed against writing sent as writable, and `dims` that are not integers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hostpool.errors import InvalidRequestError, ShareError
from hostpool.share import attach
from tests.helpers import Held, memory_cgroup
from tests.reliability.share_support import (
    F_SEAL_FUTURE_WRITE,
    NOBODY,
    SEALED,
    RogueServer,
    dir_of,
    process_fds,
    public_dir,
    punch_hole,
    rogue_head,
    rogue_memfd,
    wait_for_file,
)

__all__ = ["public_dir"]
MiB, GiB = 1 << 20, 1 << 30


def _region(
    nbytes: int, dims: list[Any] | None = None, dtype: str = "torch.uint8"
) -> dict[str, Any]:
    return {"id": 1, "name": "rogue", "dims": dims or [nbytes], "dtype": dtype, "bytes": nbytes}


def _rogue_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "rogue" in line]


@pytest.fixture
def untouched() -> Iterator[None]:
    """The client's fds and mappings are the same after the test as before it."""
    fds, maps = process_fds(), _rogue_maps()
    yield
    assert process_fds() == fds
    assert _rogue_maps() == maps


@pytest.mark.usefixtures("untouched")
def test_a_server_of_another_uid_is_refused(public_dir: str) -> None:
    path = os.path.join(dir_of(NOBODY, public_dir), "squat.sock")
    rogue = RogueServer(  # sealed against punching: another uid's fds must be (issue 36.5)
        path,
        rogue_head([_region(MiB)]),
        lambda: [rogue_memfd(MiB, seals=SEALED | F_SEAL_FUTURE_WRITE, fill=True)],
        uid=NOBODY,
    )
    try:
        with pytest.raises(ShareError, match=f"runs as uid {NOBODY}.*server_uids"):
            attach(path, "kv", timeout=30)
        with attach(path, "kv", server_uids=[NOBODY], timeout=30) as h:  # named: believed
            assert h.tensors[0].numel() == MiB
    finally:
        rogue.stop()


@pytest.mark.usefixtures("untouched")
def test_more_than_max_bytes_is_refused_before_mapping(tmp_path: Path) -> None:
    path = str(tmp_path / "big.sock")
    rogue = RogueServer(path, rogue_head([_region(4 * GiB)]), lambda: [rogue_memfd(4 * GiB)])
    try:
        with pytest.raises(ShareError, match=r"4294967296 bytes .*max_bytes 1073741824"):
            attach(path, "kv", max_bytes=GiB, prefault=True, timeout=30)
    finally:
        rogue.stop()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1GiB"])
def test_nonsensical_limits_are_invalid_requests(tmp_path: Path, bad: object) -> None:
    with pytest.raises(InvalidRequestError):
        attach(str(tmp_path / "none.sock"), "kv", max_bytes=bad)  # type: ignore[arg-type]
    if not isinstance(bad, float):  # 1.5 seconds is a fine timeout
        with pytest.raises(InvalidRequestError):
            attach(str(tmp_path / "none.sock"), "kv", timeout=bad)  # type: ignore[arg-type]
    if bad != 0:  # uid 0 is root, a uid like any other
        with pytest.raises(InvalidRequestError):
            attach(str(tmp_path / "none.sock"), "kv", server_uids=[bad])  # type: ignore[list-item]


@pytest.fixture
def cgroup_1gib(root: None) -> Iterator[Path]:
    """A real v1 memory cgroup of 1 GiB below this process's own."""
    with memory_cgroup("hostpool-test", GiB) as group:
        yield group


def test_a_sparse_pool_larger_than_the_cgroup_is_refused(tmp_path: Path, cgroup_1gib: Path) -> None:
    path = str(tmp_path / "sparse.sock")
    rogue = RogueServer(path, rogue_head([_region(4 * GiB)]), lambda: [rogue_memfd(4 * GiB)])
    try:

        def client() -> str:
            (cgroup_1gib / "cgroup.procs").write_text(str(os.getpid()))
            try:
                attach(path, "kv", prefault=True, timeout=60)
            except ShareError as exc:
                return str(exc)
            return "attached"

        held = Held(client)  # today's client is OOM-killed in its cgroup here
        held.end()
    finally:
        rogue.stop()
    assert "cgroup" in held.result and "4294967296" in held.result, held.result


@pytest.mark.hugepages
@pytest.mark.usefixtures("untouched")
def test_hugetlb_fds_only_from_a_trusted_server_or_sealed_against_punching(
    public_dir: str, hugepages_2m: int
) -> None:
    huge = 2 * MiB
    for seals, expect in ((SEALED, "punch"), (SEALED | F_SEAL_FUTURE_WRITE, None)):
        home = dir_of(NOBODY, public_dir)
        path = os.path.join(home, f"huge-{seals}.sock")
        punched = os.path.join(home, "punched")
        rogue = RogueServer(
            path,
            rogue_head([_region(huge)]),
            lambda s=seals: [rogue_memfd(huge, seals=s, hugetlb=True, fill=True)],  # type: ignore[misc]
            uid=NOBODY,
            # ... then tries to punch the hugepage out from under its client
            after_send=lambda fds, out=punched: Path(out).write_text(punch_hole(fds[0], huge)),  # type: ignore[misc]
        )
        try:
            if expect is None:

                def client(path: str = path, punched: str = punched) -> int:
                    with attach(path, "kv", server_uids=[NOBODY], timeout=30) as h:
                        wait_for_file(punched)  # the server has tried its worst
                        return int(h.tensors[0].sum())

                held = Held(client)  # a SIGBUS would end this child, not the test runner
                assert held.end() == 0 and held.result == 0
                assert Path(punched).read_text() == "EPERM"  # the seal stopped it
            else:
                with pytest.raises(ShareError, match=rf"hugetlb.*uid {NOBODY}.*{expect}"):
                    attach(path, "kv", server_uids=[NOBODY], timeout=30)
        finally:
            rogue.stop()
    # This uid's own server could kill the client anyway: its hugetlb fds are accepted.
    path = os.path.join(public_dir, "huge-own.sock")
    rogue = RogueServer(
        path, rogue_head([_region(huge)]), lambda: [rogue_memfd(huge, hugetlb=True, fill=True)]
    )
    try:
        with attach(path, "kv", timeout=30) as h:
            assert h.tensors[0].numel() == huge
    finally:
        rogue.stop()


@pytest.mark.usefixtures("untouched")
def test_a_write_sealed_fd_sent_as_writable_is_a_share_error(tmp_path: Path) -> None:
    path = str(tmp_path / "sealed.sock")
    seals = SEALED | F_SEAL_FUTURE_WRITE
    rogue = RogueServer(
        path,
        rogue_head([_region(MiB)], readonly=False),
        lambda: [rogue_memfd(MiB, seals=seals, fill=True)],
    )
    try:
        with pytest.raises(ShareError, match=r"sealed against writing \(seals 0x17\)"):
            attach(path, "kv", timeout=30)
        with attach(path, "kv", readonly=True, timeout=30) as h:  # read-only is fine
            assert h.tensors[0].numel() == MiB
    finally:
        rogue.stop()


@pytest.mark.usefixtures("untouched")
@pytest.mark.parametrize(
    ("dims", "dtype"),
    [([True], "torch.uint8"), ([1.5], "torch.uint8"), ([MiB], "torch.nonsense"), ([MiB], 7)],
)
def test_malformed_regions_are_share_errors(tmp_path: Path, dims: list[Any], dtype: Any) -> None:
    path = str(tmp_path / "dims.sock")
    rogue = RogueServer(
        path, rogue_head([_region(MiB, dims, dtype)]), lambda: [rogue_memfd(MiB, fill=True)]
    )
    try:
        with pytest.raises(ShareError, match="manifest"):
            attach(path, "kv", timeout=30)
    finally:
        rogue.stop()
