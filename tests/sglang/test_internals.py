"""sglang's internals as `hostpool.integrations.sglang.internals` relies on them (the one
place that pins them), against the installed sglang with hostpool's integration off."""

from __future__ import annotations

import importlib
import inspect
import mmap
import os
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import torch

from hostpool.integrations import sglang as integration
from hostpool.integrations.sglang import internals
from hostpool.integrations.sglang.labels import current_pool
from tests.sglang import pools
from tests.sglang.cpu_import import load_sglang


@pytest.fixture(scope="module")
def sglang_own() -> Iterator[dict[str, Any]]:
    """sglang's modules as sglang made them (the integration uninstalled meanwhile)."""
    was = integration.installed()
    integration.uninstall()
    load_sglang()
    names = (internals.COMMON, internals.MMAP, internals.BASE)
    yield {n: importlib.import_module(n) for n in names}
    if was:
        integration.install()


def test_the_installed_sglang_is_one_it_was_read_from() -> None:
    assert internals.GATE.allows(internals.installed_version()), internals.installed_version()


def test_the_entry_points_are_where_and_what_it_expects(sglang_own: dict[str, Any]) -> None:
    common = vars(sglang_own[internals.COMMON])
    base, shm = common[internals.BASE_ALLOCATOR], common[internals.SHM_ALLOCATOR]
    assert isinstance(base, type) and issubclass(shm, base)
    for name in (internals.DISPATCH, internals.TYPE_RULE, internals.PUBLISHED_CONFIG):
        assert callable(common[name]), name
    # The ROCm check is called by keyword, and answers False off ROCm.
    hip = common[internals.HIP_CHECK]
    assert list(inspect.signature(hip).parameters) == ["pin_memory", "allocator"]
    assert hip(pin_memory=True, allocator=base()) is False
    assert type(common[internals.DISPATCH]("no_such_backend")) is base  # its fallback
    # No-argument constructors; allocate(dims, dtype, device) remembers dims and dtype.
    allocator = base()
    tensor = allocator.allocate((2, 4096), torch.uint8, "cpu")
    assert tensor.shape == (2, 4096)
    assert (allocator.dims, allocator.dtype) == ((2, 4096), torch.uint8)
    mmap_module = vars(sglang_own[internals.MMAP])
    for name in (internals.ALLOC_SHM, internals.ALLOC_MMAP):
        assert list(inspect.signature(mmap_module[name]).parameters) == ["dims", "dtype"], name
    t, fd, mm = mmap_module[internals.ALLOC_SHM]((4096,), torch.uint8)
    assert isinstance(fd, int) and isinstance(mm, mmap.mmap) and t.numel() == 4096
    del t
    mm.close()
    os.close(fd)
    host_pool = vars(sglang_own[internals.BASE])[internals.HOST_POOL]
    assert callable(host_pool.__dict__[internals.DESTROY])


def test_a_host_pool_holds_its_allocator_and_label_before_it_allocates(
    sglang_own: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the labels find on the stack: the pool being built, by its `allocator`, with
    its `pool_label`; and what destroy() releases: `vars(pool)["allocator"]`."""
    base = vars(sglang_own[internals.COMMON])[internals.BASE_ALLOCATOR]
    seen: list[str] = []
    original = base.allocate

    def allocate(self: Any, dims: Any, dtype: Any, device: str) -> Any:
        seen.append(current_pool(self))
        return original(self, dims, dtype, device)

    monkeypatch.setattr(base, "allocate", allocate)
    pool = pools.mha("layer_first", "default", "probe-label")
    assert seen and set(seen) == {"probe-label"}
    assert type(vars(pool)[internals.POOL_ALLOCATOR]) is base
    assert vars(pool)[internals.POOL_LABELS[0]] == "probe-label"
    pool.destroy()


def test_outside_its_versions_install_leaves_sglang_alone(
    sglang_own: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(internals, "installed_version", lambda: "0.6.0")
    common = vars(sglang_own[internals.COMMON])
    original = common[internals.DISPATCH]
    with structlog.testing.capture_logs() as logs:
        integration.install()
        try:
            assert common[internals.DISPATCH] is original
            assert vars(sglang_own[internals.MMAP])[internals.ALLOC_SHM].__module__ == (
                internals.MMAP
            )
        finally:
            integration.uninstall()
    [warned] = [e for e in logs if e["event"] == "hostpool.untested_version"]
    assert (warned["package"], warned["installed"], warned["tested"]) == (
        "sglang",
        "0.6.0",
        ">=0.5.23,<0.5.24",
    )
