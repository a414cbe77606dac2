"""Hugepage planning: hugetlb, then transparent hugepages, then normal pages, each
fallback with a reason from a fixed set. `hostpool doctor` runs this same code."""

from __future__ import annotations

from dataclasses import dataclass

from hostpool.base.units import format_size
from hostpool.errors import HugepageUnavailableError
from hostpool.memory import kernel, thp
from hostpool.memory.options import RegionOptions
from hostpool.words import AllocatorKind, FallbackReason


@dataclass(frozen=True)
class HugepagePlan:
    hugetlb_size: int | None
    thp: bool  # MADV_HUGEPAGE the mapping
    fallbacks: tuple[FallbackReason, ...]
    thp_avoid: bool = False  # MADV_NOHUGEPAGE: THP is `always` here but costs more


@dataclass(frozen=True)
class ThpChoice:
    """Whether to ask for transparent hugepages, and why (doctor prints `why`)."""

    advise: bool
    avoid: bool  # THP would come unasked (`always`): opt the mapping out
    reason: FallbackReason | None  # the fallback reason when not advised
    why: str


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
    kind: AllocatorKind,
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
    reason: FallbackReason | None = None
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
            raise HugepageUnavailableError(
                required_message(size, need, pool),
                need_bytes=need * size,
                available_bytes=pool.available * size if pool is not None else 0,
            )
        raise HugepageUnavailableError(
            f"hugepages='required' cannot be met by the {kind} allocator on {backend}: "
            f"{reason}; use the shm or mmap allocator with memfd"
        )
    return thp_plan((reason,), kind, nbytes)


def thp_choice(kind: AllocatorKind, nbytes: int, facts: thp.ThpFacts) -> ThpChoice:
    """THP for a mapping of `nbytes`, chosen from this host's settings and state.

    A THP fault zeroes 2 MiB at once, 512 times fewer faults, when a free 2 MiB block is
    at hand and backed. Two things here make it slower than 4 KiB faults instead: free
    page reporting (VMs) hands free 2 MiB blocks back to the host, so each THP fault
    waits for the host to back its block (docs/ARCHITECTURE.md, "Measurements"); and a
    `defrag` setting that makes a MADV_HUGEPAGE fault stall in direct compaction when
    free 2 MiB blocks run short.
    """
    mode = facts.shmem_enabled if kind == "shm" else facts.enabled
    allowed = (
        ("always", "within_size", "advise", "force") if kind == "shm" else ("always", "madvise")
    )
    knob = "shmem_enabled" if kind == "shm" else "enabled"
    if kind == "torch" or mode not in allowed:
        why = (
            "torch memory is malloc'd"
            if kind == "torch"
            else f"transparent_hugepage/{knob} is {mode or 'absent'}"
        )
        return ThpChoice(False, False, "thp_disabled", why)
    costly: str | None = None
    if facts.reporting_takes_hugepage_blocks:
        costly = (
            f"free page reporting hands free blocks of order {facts.reporting_order} and up "
            "back to the host, so a THP fault waits for the host to back 2 MiB while 4 KiB "
            "faults take memory the guest still holds"
        )
    elif facts.defrag_stalls and facts.free_hugepage_bytes < nbytes:
        costly = (
            f"defrag is {facts.defrag} and free 2 MiB blocks hold "
            f"{format_size(facts.free_hugepage_bytes)}, short of {format_size(nbytes)}: "
            "MADV_HUGEPAGE faults would stall in direct compaction"
        )
    if costly is not None:
        return ThpChoice(False, mode == "always", "thp_costly", costly)
    return ThpChoice(
        True,
        False,
        None,
        f"{knob} is {mode}, defrag {facts.defrag}, "
        f"{format_size(facts.free_hugepage_bytes)} in free 2 MiB blocks, "
        "no reporting of 2 MiB blocks",
    )


def thp_plan(
    fallbacks: tuple[FallbackReason, ...], kind: AllocatorKind, nbytes: int = 0
) -> HugepagePlan:
    choice = thp_choice(kind, nbytes, thp.read_facts())
    if choice.advise:
        return HugepagePlan(None, True, fallbacks)
    assert choice.reason is not None
    return HugepagePlan(None, False, (*fallbacks, choice.reason), thp_avoid=choice.avoid)
