"""The shared pieces of the memory layer: a region's facts and its holder, the sysfs choice
reader, the memfd probes, option checks and budget refusals (each once, used by all)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from hostpool.core.budget import FixedBudget
from hostpool.errors import AllocationError, InvalidRequestError
from hostpool.memory import kernel, syscalls
from hostpool.memory.holders import (
    FOREIGN_BACKEND,
    adopt,
    holder_over_tensor,
    region_over,
)
from hostpool.memory.options import RegionOptions


def test_a_region_over_a_tensor_takes_address_and_size_from_its_holder() -> None:
    tensor = torch.arange(1000, dtype=torch.int32)
    holder = holder_over_tensor(tensor, 4000)
    gone: list[int] = []
    region = region_over(
        holder,
        lambda rid, *a, **k: gone.append(rid),
        pool="facts",
        kind="torch",
        backend="torch",
        requested_bytes=3999,
        populate_mode="touch",
    )
    facts = region.facts
    assert (facts.address, facts.mapped_bytes) == (tensor.data_ptr(), 4000)
    assert (facts.pool, facts.kind, facts.backend) == ("facts", "torch", "torch")
    assert (facts.requested_bytes, facts.populate_mode, facts.name) == (3999, "touch", None)
    assert facts.page_size == syscalls.PAGE_SIZE and facts.hugepage_fallbacks == ()
    assert holder.keeps_alive is tensor  # the memory's owner lives as long as the holder
    del holder
    assert gone == [facts.id]  # the holder's end is the region's


def test_the_facts_are_fixed_at_birth() -> None:
    holder = holder_over_tensor(torch.zeros(8, dtype=torch.uint8), 8)
    region = region_over(
        holder, None, pool="facts", kind="torch", backend="torch", requested_bytes=8
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        region.facts.pool = "other"  # type: ignore[misc]
    ids = {region.facts.id}
    for _ in range(3):
        more = holder_over_tensor(torch.zeros(8, dtype=torch.uint8), 8)
        ids.add(
            region_over(
                more, None, pool="facts", kind="torch", backend="torch", requested_bytes=8
            ).facts.id
        )
    assert len(ids) == 4  # each region its own id


def test_a_keyword_region_lacks_is_a_type_error() -> None:
    holder = holder_over_tensor(torch.zeros(8, dtype=torch.uint8), 8)
    with pytest.raises(TypeError):
        region_over(
            holder,
            None,
            pool="facts",
            kind="torch",
            backend="torch",
            requested_bytes=8,
            colour="red",
        )


def test_adopted_memory_is_recorded_as_it_was() -> None:
    tensor = torch.ones(3, 5, dtype=torch.float64)
    region, view = adopt(tensor, "facts", None)
    facts = region.facts
    assert facts.backend == FOREIGN_BACKEND and facts.kind == "torch"
    assert facts.address == tensor.data_ptr() == view.data_ptr()
    assert facts.mapped_bytes == facts.requested_bytes == 3 * 5 * 8
    assert facts.populate_mode == "none" and facts.populate_seconds == 0.0
    assert view.shape == (3, 5) and bool((view == 1).all())


@pytest.mark.parametrize(
    ("text", "chosen"),
    [
        ("always [madvise] never\n", "madvise"),
        ("always defer [defer+madvise] madvise never\n", "defer+madvise"),
        ("[always] within_size advise never deny force\n", "always"),
        ("always madvise never\n", None),
    ],
)
def test_bracketed_reads_the_selected_choice(tmp_path: Path, text: str, chosen: str) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    assert kernel.bracketed(path) == chosen
    assert kernel.bracketed(tmp_path / "absent") is None


def _kernel_takes(flags: int) -> bool:
    try:
        fd = os.memfd_create("hostpool.facts", os.MFD_CLOEXEC | flags)
    except OSError:
        return False
    os.close(fd)
    return True


def test_the_memfd_probes_agree_with_the_kernel() -> None:
    assert kernel.probe_memfd() is _kernel_takes(0)
    assert kernel.probe_noexec_seal() is _kernel_takes(syscalls.MFD_NOEXEC_SEAL)
    assert kernel.probe_sealing() is _kernel_takes(os.MFD_ALLOW_SEALING)
    before = set(os.listdir("/proc/self/fd"))
    kernel.probe_memfd(), kernel.probe_noexec_seal(), kernel.probe_sealing()
    assert set(os.listdir("/proc/self/fd")) <= before  # every probe fd closed


def test_hugepage_pools_are_the_sizes_hugepage_pool_reads() -> None:
    pools = kernel.hugepage_pools()
    for size, pool in pools.items():
        assert pool.page_size == size
        assert kernel.hugepage_pool(size) is not None
    assert kernel.hugepage_pool(3 << 10) is None  # no such size


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hugepages": "sometimes"}, "hugepages must be one of ('off', 'prefer', 'required')"),
        ({"populate": "lazy"}, "populate must be one of ("),
        ({"shm_backend": "tmp"}, "shm_backend must be one of ('auto', 'memfd', 'devshm')"),
        ({"pin": 1}, "pin must be True or False, got 1"),
        ({"seal": "yes"}, "seal must be True or False, got 'yes'"),
    ],
)
def test_each_bad_option_is_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RegionOptions.parse(**options)


def test_good_options_come_through() -> None:
    parsed = RegionOptions.parse(hugepages=None, populate="touch", pin=False, seal=False)
    assert (parsed.hugepages, parsed.populate, parsed.pin, parsed.seal) == (
        "off",
        "touch",
        False,
        False,
    )


def test_a_budget_refusal_carries_its_figures_never_below_zero() -> None:
    budget = FixedBudget(10)
    budget.admit(2, 8)  # fits exactly
    with pytest.raises(AllocationError) as short:
        budget.admit(5, 8)
    assert (short.value.reason, short.value.need_bytes) == ("budget", 5)
    assert (short.value.available_bytes, short.value.limit_bytes) == (2, 10)
    assert str(short.value) == (
        "budget refused: need 5 bytes (5B) with 8 bytes (8B) already held, budget 10 bytes "
        "(10B) (explicit budget)"
    )
    with pytest.raises(AllocationError) as over:
        budget.admit(1, 25)  # already past it
    assert over.value.available_bytes == 0
