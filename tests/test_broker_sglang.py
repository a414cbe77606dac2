"""sglang's host pools on the broker's memory (HOSTPOOL_BROKER): the real, pinned sglang
0.5.23's host pool, built through hostpool's stand-in allocator, gets its buffers from
`hostpool serve`'s pool of the same name, and a pool built again after `destroy()` (an
engine restarted) finds what the first one wrote."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hostpool.core.ledger import get_ledger
from hostpool.errors import ShareError
from hostpool.integrations.sglang.standins import BROKER_VARIABLE
from tests.sglang import pools
from tests.sglang.cpu_import import integration_installed
from tests.test_serve import Served, start_serve

LABEL = "sgkv"


@pytest.fixture(scope="module")
def sglang() -> Iterator[None]:
    with integration_installed():
        yield


@pytest.fixture
def broker(tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    sock = os.path.join(tmp_path, "run", "broker.sock")
    served = start_serve(tmp_path, "--pool", f"{LABEL}=1MiB", "--share-socket", sock)
    monkeypatch.setenv(BROKER_VARIABLE, sock)
    yield served
    served.kill()


def _page(pool: Any) -> torch.Tensor:
    dummy = pool.get_dummy_flat_data_page()
    return (torch.arange(dummy.numel()) % 251 + 1).to(dummy.dtype)


def test_a_host_pool_takes_its_memory_from_the_broker(sglang: None, broker: Served) -> None:
    first = pools.mha("layer_first", "shm", LABEL)
    try:
        # nothing allocated here: no region of the pool in this process's ledger
        assert [r for r in get_ledger().snapshot() if r.pool == LABEL] == []
        assert 'hostpool_broker_leases{pool="sgkv"} 1.0' in broker.get("/metrics")[1]
        page = _page(first)
        first.set_from_flat_data_page(1, page)
        assert torch.equal(first.get_data_page(1).flatten(), page)
        # the lease is exclusive: a second pool of the same name is refused, naming us
        with pytest.raises(ShareError, match=f"leased by pid {os.getpid()}"):
            pools.mha("layer_first", "shm", LABEL)
    finally:
        first.destroy()
    del first
    again = pools.mha("layer_first", "shm", LABEL)  # the engine, restarted
    try:
        assert torch.equal(again.get_data_page(1).flatten(), page)
    finally:
        again.destroy()
