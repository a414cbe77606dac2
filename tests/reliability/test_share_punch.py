"""Issue 36.5: a server cannot OOM-kill its client after the attach by punching holes.

A client maps the server's shmem pages; if the server then punches a hole
(`fallocate(PUNCH_HOLE)` or `MADV_REMOVE`), the client's next touch of those pages
allocates fresh ones, charged to the client's cgroup (measured here on a real v1 memory
cgroup): the attach-time budget check cannot see it coming. A server of this uid or root
could kill the client anyway; from a server of another uid, `attach()` accepts only fds
sealed against punching (F_SEAL_FUTURE_WRITE: the kernel then refuses the punch, EPERM),
unless the client passes `allow_unsealed=True`, which accepts exactly that risk (shown
below, with the figures).

The server is a real process of another uid (`RogueServer`, uid 65534) that punches the
whole region once the fds are sent; the client is a forked process in its own memory
cgroup that waits for the punch, reads every page, and reports what its cgroup was
charged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostpool.errors import ShareError
from hostpool.share import attach
from tests.helpers import Held, memory_cgroup
from tests.reliability.share_support import (
    F_SEAL_FUTURE_WRITE,
    NOBODY,
    SEALED,
    RogueServer,
    dir_of,
    public_dir,
    punch_hole,
    rogue_head,
    rogue_memfd,
    wait_for_file,
)
from tests.waiting import wait_for

__all__ = ["public_dir"]
MiB = 1 << 20
SIZE = 64 * MiB


@pytest.fixture
def cgroup(root: None) -> Iterator[Path]:
    """A real v1 memory cgroup below this process's own, for the client."""
    with memory_cgroup("hostpool-punch") as group:
        yield group


def _serve_and_punch(path: str, seals: int, punched: str, *, readonly: bool = True) -> RogueServer:
    """A server of uid 65534 that, once the client says `go`, punches the whole region."""
    region = {"id": 1, "name": "rogue", "dims": [SIZE], "dtype": "torch.uint8", "bytes": SIZE}

    def punch(fds: list[int]) -> None:
        assert punched is not None
        wait_for(lambda: os.path.exists(punched + ".go"), "the client's go")
        Path(punched).write_text(punch_hole(fds[0], SIZE))

    return RogueServer(
        path,
        rogue_head([region], readonly=readonly),
        lambda: [rogue_memfd(SIZE, seals=seals, fill=True)],
        uid=NOBODY,
        after_send=None if punched is None else punch,
    )


def _client(path: str, punched: str, group: Path, **options: bool) -> dict[str, int | str]:
    """In its own cgroup: attach, touch every page once (whatever this process itself
    allocates doing so is charged before the measure), let the server punch, touch every
    page again, and report what that second pass charged to the cgroup."""

    def run() -> dict[str, int | str]:
        (group / "cgroup.procs").write_text(str(os.getpid()))
        usage = group / "memory.usage_in_bytes"
        with attach(path, "kv", server_uids=[NOBODY], timeout=60, **options) as h:
            pages = h.tensors[0][::4096]  # one byte a page: every page touched
            int(pages.sum())
            Path(punched + ".go").write_text("go")
            wait_for_file(punched)
            before = int(usage.read_text())
            total = int(pages.sum())
            return {"charged": int(usage.read_text()) - before, "sum": total}

    held = Held(run)
    assert held.end() == 0
    return {**held.result, "punch": Path(punched).read_text()}


def test_an_unsealed_memfd_from_another_uid_is_refused(public_dir: str) -> None:
    home = dir_of(NOBODY, public_dir)
    path = os.path.join(home, "unsealed.sock")
    # Granted writable: a writable mapping cannot coexist with the seal, so never accepted.
    rogue = _serve_and_punch(path, SEALED, None, readonly=False)
    try:
        for readonly in (None, True, False):
            with pytest.raises(ShareError, match=rf"uid {NOBODY} .*not sealed against hole punch"):
                attach(path, "kv", readonly=readonly, server_uids=[NOBODY], timeout=30)
    finally:
        rogue.stop()


def test_a_sealed_memfd_cannot_be_punched_under_its_client(public_dir: str, cgroup: Path) -> None:
    home = dir_of(NOBODY, public_dir)
    path, punched = os.path.join(home, "sealed.sock"), os.path.join(home, "punched")
    rogue = _serve_and_punch(path, SEALED | F_SEAL_FUTURE_WRITE, punched)
    try:
        got = _client(path, punched, cgroup)
    finally:
        rogue.stop()
    assert got["punch"] == "EPERM"  # the kernel refused the server
    assert got["sum"] == 0  # rogue_memfd's pages are zero, and still the server's
    assert int(got["charged"]) < SIZE // 4, got  # nothing faulted anew


def test_allow_unsealed_accepts_what_a_punch_costs(public_dir: str, cgroup: Path) -> None:
    """What is left, measured: with allow_unsealed=True the punch succeeds and the client's
    cgroup pays for every page it touches afterwards."""
    home = dir_of(NOBODY, public_dir)
    path, punched = os.path.join(home, "open.sock"), os.path.join(home, "punched")
    rogue = _serve_and_punch(path, SEALED, punched)
    try:
        got = _client(path, punched, cgroup, allow_unsealed=True)
    finally:
        rogue.stop()
    assert got["punch"] == "punched"
    assert int(got["charged"]) >= SIZE * 3 // 4, got
