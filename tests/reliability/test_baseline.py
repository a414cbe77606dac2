"""The baseline every reliability test is checked against measures this process tree."""

from __future__ import annotations

import os
import sys
import textwrap

from tests import helpers
from tests.reliability.conftest import SHMEM_SLACK

MiB = 1 << 20
HOLDER = textwrap.dedent(
    """
    import mmap, os, sys
    fd = os.memfd_create("outsider")
    os.ftruncate(fd, 64 << 20)
    mm = mmap.mmap(fd, 64 << 20)
    mm.write(b"x" * (64 << 20))
    print("holding", flush=True)
    sys.stdin.read()
    """
)


def test_shared_memory_of_an_unrelated_process_is_not_ours() -> None:
    """64 MiB held by a process outside our tree moves the host's Shmem, not the check."""
    out_r, out_w = os.pipe()  # the outsider says "holding" here
    in_r, in_w = os.pipe()  # its stdin: it exits when we close in_w
    pid = os.fork()
    if pid == 0:  # an intermediate that exits: the holder is reparented, no longer ours
        try:
            os.setsid()
            if os.fork() == 0:
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.execv(sys.executable, [sys.executable, "-c", HOLDER])
        finally:
            os._exit(0)
    os.close(in_r)
    os.close(out_w)
    os.waitpid(pid, 0)
    host_before = helpers.shmem_bytes()
    ours_before = helpers.tree_shmem_bytes()
    try:
        with os.fdopen(out_r, "r") as reader:
            assert reader.readline() == "holding\n"
        host = helpers.shmem_bytes()
        ours = helpers.tree_shmem_bytes()
        assert abs(ours - ours_before) < SHMEM_SLACK
        # ...while a child of ours holding the same is counted.
        child = helpers.python_child(HOLDER.replace("holding", "ready"))
        try:
            assert helpers.tree_shmem_bytes() >= ours + 64 * MiB
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=30)
        assert host >= host_before + 64 * MiB - SHMEM_SLACK  # the outsider really held it
    finally:
        os.close(in_w)  # the outsider's stdin ends: it exits
