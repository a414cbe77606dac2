"""Every reliability test must leave the process as it found it: hostpool fds, mappings,
the ledger, and Shmem within 16 MiB of its baseline."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

from hostpool.lifecycle import get_ledger
from tests import helpers

SOAK = os.environ.get("HOSTPOOL_SOAK") == "1"
SHMEM_SLACK = 16 << 20


@pytest.fixture(autouse=True)
def back_to_baseline() -> Iterator[None]:
    ledger = get_ledger()
    gc.collect()
    ledger.drain()
    fds = helpers.fd_links()
    maps = helpers.maps_lines("hostpool.")
    ids = {r.id for r in ledger.snapshot()}
    shmem = helpers.shmem_bytes()
    yield
    gc.collect()
    ledger.drain()
    assert helpers.fd_links() == fds
    assert helpers.maps_lines("hostpool.") == maps
    assert {r.id for r in ledger.snapshot()} == ids
    assert helpers.shmem_bytes() <= shmem + SHMEM_SLACK
