from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests import helpers


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hugepages: reserves hugetlb pages (root)")


@pytest.fixture
def no_leaked_fds() -> Iterator[None]:
    """The test must leave no hostpool fd and no hostpool mapping behind."""
    import gc

    from hostpool.core.ledger import get_ledger

    before_fds = set(helpers.fd_links())
    before_maps = len(helpers.maps_lines("hostpool."))
    yield
    gc.collect()
    get_ledger().drain()
    assert set(helpers.fd_links()) - before_fds == set()
    assert len(helpers.maps_lines("hostpool.")) <= before_maps


@pytest.fixture
def root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")


@pytest.fixture
def hugepages_2m(root: None) -> Iterator[int]:
    """2,048 free 2 MiB pages would be 4 GiB: tests ask only for what they use."""
    with helpers.reserved_hugepages(64) as got:
        if got < 8:
            pytest.skip(f"could reserve only {got} hugepages")
        yield got


@pytest.fixture(autouse=True)
def hostpool_events_enabled() -> Iterator[None]:
    """Let every event through the level guard so capture_logs sees info and debug too."""
    import logging

    logger = logging.getLogger("hostpool")
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield
    logger.setLevel(old)


@pytest.fixture
def fake_cuda() -> Iterator[helpers.FakeCuda]:
    """A fake CUDA runtime behind hostpool's seam (no GPU is lent to most runs)."""
    from hostpool.memory import cuda

    fake = helpers.FakeCuda()
    previous = cuda.set_runtime(fake)
    try:
        yield fake
    finally:
        cuda.set_runtime(previous)
