"""A pool's options are parsed once: the config's PoolSpec carries the RegionOptions value
that serve's allocator then uses as is, and a wrong option names its config key."""

from __future__ import annotations

import ctypes

import pytest

from hostpool.core.allocators import ShmHostTensorAllocator
from hostpool.errors import ConfigError, InvalidRequestError
from hostpool.memory.options import RegionOptions
from hostpool.serve.config import from_mapping
from hostpool.serve.service import PoolService


def test_the_spec_carries_parsed_options_and_serve_uses_that_value() -> None:
    config = from_mapping({"pools": {"kv": {"size": "1MiB", "populate": "touch", "pin": False}}})
    (spec,) = config.pools
    assert spec.options == RegionOptions(populate="touch")
    service = PoolService(config)
    try:
        service.allocate_all()
        served = service.pools["kv"]
        assert served.allocator.options is spec.options  # not parsed again
        assert sum(ctypes.sizeof(b) for b in served.regions) == 1 << 20  # buffers, not tensors
    finally:
        report = service.close()
    assert not report.leaks
    assert service.pools["kv"].regions == []


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"populate_threads": 999}, "pools.kv.populate_threads"),
        ({"pin": "yes"}, "pools.kv.pin"),
        ({"numa_node": -1}, "pools.kv.numa_node"),
        ({"fallback_dir": "/nonexistent-dir"}, "pools.kv.fallback_dir"),
    ],
)
def test_a_wrong_option_names_its_config_key(table: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        from_mapping({"pools": {"kv": {"size": "1MiB", **table}}})


def test_options_once_or_keywords_not_both() -> None:
    with pytest.raises(InvalidRequestError, match="not both"):
        ShmHostTensorAllocator("kv", region_options=RegionOptions(), populate="touch")
    with pytest.raises(InvalidRequestError) as raised:
        RegionOptions.parse(populate="sometimes")
    assert raised.value.option == "populate"
