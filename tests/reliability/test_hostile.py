"""Hostile input, hypothesis-driven: whatever comes in, a typed error or a result, no leak."""

from __future__ import annotations

import json
import os
from dataclasses import fields

import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hostpool import HostPoolError, ShmHostTensorAllocator, get_allocator_type
from hostpool.errors import ConfigError
from hostpool.memory.options import RegionOptions
from hostpool.serve.config import from_mapping

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=8),
)
dims_values = st.one_of(
    scalars, st.lists(st.one_of(st.integers(-4, 1 << 20), scalars), max_size=4).map(tuple)
)
dtypes = st.one_of(
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float8_e4m3fn]),
    scalars,
)
option_values = st.dictionaries(
    st.sampled_from([f.name for f in fields(RegionOptions)] + ["bogus"]),
    st.one_of(
        scalars, st.sampled_from(["off", "prefer", "required", "auto", "none", "2MB", "1GB"])
    ),
    max_size=3,
)


@settings(max_examples=150, deadline=None)
@given(
    dims=dims_values,
    dtype=dtypes,
    options=option_values,
    pool=st.one_of(st.text(max_size=70), scalars),
)
def test_allocate_never_crashes_or_leaks(
    dims: object, dtype: object, options: dict[str, object], pool: object
) -> None:
    try:
        alloc = ShmHostTensorAllocator(pool, **{"populate": "none", **options})  # type: ignore[arg-type]
    except HostPoolError:
        return
    try:
        t = alloc.allocate(dims, dtype)  # type: ignore[arg-type]
    except HostPoolError:
        pass
    else:
        assert t.dtype == dtype
        del t
    finally:
        alloc.close()


@settings(max_examples=100, deadline=None)
@given(
    config=st.recursive(
        scalars,
        lambda inner: st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )
)
def test_serve_configs_are_accepted_or_config_errors(config: object) -> None:
    try:
        parsed = from_mapping(config if isinstance(config, dict) else {"pools": config})
    except ConfigError:
        return
    assert parsed.pools and all(p.size > 0 for p in parsed.pools)


@settings(max_examples=100, deadline=None)
@given(
    extra=st.recursive(
        scalars, lambda inner: st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8
    ),
    fmt=st.sampled_from(["json", "yaml", "inline", "raw"]),
)
def test_extra_configs_resolve_or_fail_typed(
    tmp_path_factory: object, extra: object, fmt: str
) -> None:
    if fmt == "inline":
        value: object = json.dumps(extra, default=str)
    elif fmt == "raw":
        value = extra
    else:
        directory = tmp_path_factory.mktemp("extra")  # type: ignore[attr-defined]
        path = os.path.join(directory, f"extra.{fmt}")
        with open(path, "w") as f:
            f.write(json.dumps(extra, default=str) if fmt == "json" else yaml.safe_dump(extra))
        value = "@" + path
    args = {"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config": value}
    try:
        result = get_allocator_type(args)
    except ConfigError:
        return
    assert result in ("shm", "dynamic")
