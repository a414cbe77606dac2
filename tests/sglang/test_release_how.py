"""How sglang's host pools end, on the real pinned sglang (issue 26 point 1): `destroy()` is
`explicit`, a pool dropped without it is `finalizer` (the leak signal) for every allocator
type hostpool stands in for, and `alloc_shm`/`alloc_mmap` used by contract (sglang's nixl
backend and weight checker) are never the leak signal."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch

from hostpool.core.ledger import get_ledger
from tests import helpers
from tests.sglang import pools
from tests.sglang.cpu_import import integration_installed


@pytest.fixture(scope="module")
def sglang_installed() -> Iterator[None]:
    with integration_installed():
        yield


def _releases(pool: str) -> dict[str, int]:
    ledger = get_ledger()
    ledger.drain()
    return {how: n for (p, how), n in ledger.counters().releases_total.items() if p == pool and n}


@pytest.mark.parametrize("allocator_type", ["default", "shm"])
@pytest.mark.parametrize(
    ("ending", "how"),
    [("dropped", "finalizer"), ("destroyed", "explicit")],
    ids=["dropped_without_destroy_is_the_leak_signal", "destroy_is_explicit"],
)
def test_how_a_pool_ended_is_counted(
    sglang_installed: None, no_leaked_fds: None, allocator_type: str, ending: str, how: str
) -> None:
    """A pool dropped without `destroy()` is released by its finalizer (the leak signal);
    one destroyed first is released explicitly."""
    label = f"{ending}_{allocator_type}"
    pool = pools.mha("layer_first", allocator_type, label)
    assert [r.pool for r in get_ledger().snapshot([label])] == [label]
    if ending == "destroyed":
        pool.destroy()
    del pool
    gc.collect()
    assert get_ledger().snapshot([label]) == []
    assert _releases(label) == {how: 1}


def test_sglang_alloc_shm_and_alloc_mmap_used_by_contract_are_never_the_leak_signal(
    sglang_installed: None, no_leaked_fds: None
) -> None:
    from sglang.srt.mem_cache.storage.mmap import alloc_mmap, alloc_shm

    before = {how: n for how, n in _releases("default").items()}
    tensor, fd, mm = alloc_shm((1024,), torch.float32)
    address = tensor.data_ptr()
    os.close(fd)
    mm.close()  # the caller's explicit release; the pages go with the tensor
    del tensor, mm
    arena = alloc_mmap((4096,), torch.uint8)  # nixl's staging buffer, weight checker's arena
    del arena
    gc.collect()
    after = _releases("default")
    delta = {how: n - before.get(how, 0) for how, n in after.items() if n != before.get(how, 0)}
    assert delta == {"explicit": 1, "tensor": 1}
    assert not helpers.range_mapped(address, 4096)
