"""Hugepage planning: hugetlb, then transparent hugepages, then normal pages, each
fallback with a reason from a fixed set. `hostpool doctor` runs this same code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hostpool.errors import HugepageUnavailableError
from hostpool.memory import kernel
from hostpool.memory.options import RegionOptions
from hostpool.units import format_size

Kind = Literal["shm", "mmap", "torch"]

# The fixed set of hugepage fallback reasons (label `reason` of
# hostpool_hugepage_fallbacks_total), documented in metrics/README.md.
FALLBACK_REASONS = (
    "hugetlb_pool_short",  # not enough free hugetlb pages of that size (or mmap ENOMEM)
    "hugetlb_unsupported",  # no pool of that size on this host, or the allocator cannot
    "thp_disabled",  # transparent hugepages are off for this kind of memory
    "devshm_no_hugepages",  # the /dev/shm fallback file cannot use hugetlb
)


@dataclass(frozen=True)
class HugepagePlan:
    hugetlb_size: int | None
    thp: bool
    fallbacks: tuple[str, ...]


def required_message(size: int, need_pages: int, pool: kernel.HugepagePool | None) -> str:
    label = format_size(size)
    sysdir = f"/sys/kernel/mm/hugepages/hugepages-{size // 1024}kB/nr_hugepages"
    if pool is None:
        return (
            f"hugepages='required' with {label} pages, but this host has no {label} hugetlb "
            f"pool ({sysdir} is missing); use a size the host has or hugepages='prefer'"
        )
    want = pool.total + need_pages - pool.available
    return (
        f"hugepages='required': need {need_pages} pages of {label}, {pool.available} free "
        f"(free {pool.free} minus reserved {pool.reserved}); reserve more with "
        f"`echo {want} > {sysdir}`"
        + (" (or `sysctl -w vm.nr_hugepages=" + str(want) + "`)" if size == 2 << 20 else "")
    )


def plan_hugepages(
    kind: Kind,
    backend: str,
    nbytes: int,
    options: RegionOptions,
    *,
    hugetlb_failed: bool = False,
) -> HugepagePlan:
    """Decide hugetlb, THP or normal pages, with the reason for each fallback.

    The same code answers `hostpool doctor`'s "what would auto choose".
    """
    if options.hugepages == "off":
        return HugepagePlan(None, False, ())
    size = options.hugepage_size
    need = -(-max(nbytes, 1) // size)
    reason: str | None = None
    pool = None
    if kind == "torch":
        reason = "hugetlb_unsupported"
    elif backend == "devshm":
        reason = "devshm_no_hugepages"
    else:
        pool = kernel.hugepage_pool(size)
        if pool is None:
            reason = "hugetlb_unsupported"
        elif hugetlb_failed or pool.available < need:
            reason = "hugetlb_pool_short"
    if reason is None:
        return HugepagePlan(size, False, ())
    if options.hugepages == "required":
        if reason == "hugetlb_pool_short" or (reason == "hugetlb_unsupported" and kind != "torch"):
            raise HugepageUnavailableError(required_message(size, need, pool))
        raise HugepageUnavailableError(
            f"hugepages='required' cannot be met by the {kind} allocator on {backend}: "
            f"{reason}; use the shm or mmap allocator with memfd"
        )
    return thp_plan((reason,), kind)


def thp_plan(fallbacks: tuple[str, ...], kind: Kind) -> HugepagePlan:
    allowed = kernel.shmem_thp_allowed() if kind == "shm" else kernel.anon_thp_allowed()
    if kind != "torch" and allowed:
        return HugepagePlan(None, True, fallbacks)
    return HugepagePlan(None, False, (*fallbacks, "thp_disabled"))
