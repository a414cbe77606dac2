"""Real memory limits for tests: a cgroup v2 hugetlb group (root). The v1 memory cgroup
is `tests.helpers.memory_cgroup`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def hugetlb_cgroup(name: str, max_2mb: int) -> Iterator[str]:
    """A v2 cgroup `name`-PID with `hugetlb.2MB.max` set to `max_2mb` bytes, below the
    unified hierarchy's root (hugetlb enabled in its subtree); skips the test where that
    hierarchy has no hugetlb controller. Removed afterwards (the test moves nothing it
    keeps into it)."""
    import pytest

    unified = "/sys/fs/cgroup/unified"
    if not os.path.exists(os.path.join(unified, "cgroup.controllers")):
        unified = "/sys/fs/cgroup"
    with open(os.path.join(unified, "cgroup.controllers")) as f:
        if "hugetlb" not in f.read().split():
            pytest.skip("no hugetlb controller in the v2 hierarchy")
    with open(os.path.join(unified, "cgroup.subtree_control"), "w") as f:
        f.write("+hugetlb")
    group = os.path.join(unified, f"{name}-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "hugetlb.2MB.max"), "w") as f:
            f.write(str(max_2mb))
        yield group
    finally:
        os.rmdir(group)
