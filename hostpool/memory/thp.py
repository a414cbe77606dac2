"""Transparent hugepage facts: what `MADV_HUGEPAGE` would make a page fault do on this host.

Read from /sys and /proc, never guessed. The choice made from them is
`hugepages.thp_choice`'s; `hostpool doctor` prints both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hostpool.memory.kernel import bracketed

THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
PAGE_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
BUDDYINFO = Path("/proc/buddyinfo")
BASE_PAGE = 4096

# `defrag` values under which a fault in a MADV_HUGEPAGE range, finding no free 2 MiB
# block, stalls in direct reclaim/compaction instead of falling back to 4 KiB pages.
STALLING_DEFRAG = ("always", "madvise", "defer+madvise")


@dataclass(frozen=True)
class ThpFacts:
    """The kernel settings and state a THP fault depends on."""

    enabled: str | None  # anonymous THP: always, madvise, never (None: no THP support)
    shmem_enabled: str | None  # always, within_size, advise, never, deny, force
    defrag: str | None  # always, defer, defer+madvise, madvise, never
    hugepage_bytes: int  # the PMD hugepage size (2 MiB on x86-64)
    # Free page reporting (a VM's balloon) hands free blocks of this order and up back
    # to the host; None where no device reports. A THP fault takes such a block.
    reporting_order: int | None
    free_hugepage_bytes: int  # bytes in free blocks of hugepage order or larger, all zones

    @property
    def hugepage_order(self) -> int:
        return (self.hugepage_bytes // BASE_PAGE).bit_length() - 1

    @property
    def defrag_stalls(self) -> bool:
        """A MADV_HUGEPAGE fault waits for compaction when no free block is at hand."""
        return self.defrag in STALLING_DEFRAG

    @property
    def reporting_takes_hugepage_blocks(self) -> bool:
        """Free 2 MiB blocks go back to the host: a THP fault then waits for the host to
        back its 2 MiB, page by page, unlike 4 KiB faults served from blocks it holds."""
        return self.reporting_order is not None and self.reporting_order <= self.hugepage_order


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def reporting_order(path: Path = PAGE_REPORTING_ORDER) -> int | None:
    """The order free page reporting starts at, or None when nothing reports.

    The parameter exists wherever the kernel has CONFIG_PAGE_REPORTING; it holds -1
    (read back as an unsigned value) until a device such as virtio-balloon registers.
    """
    order = _read_int(path)
    if order is None or order < 0 or order > 20:
        return None
    return order


def free_block_bytes(min_order: int, path: Path = BUDDYINFO) -> int:
    """Bytes in free blocks of `min_order` or larger (/proc/buddyinfo, every zone)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    total = 0
    for line in lines:
        counts = line.split()[4:]  # "Node 0, zone Normal c0 c1 ..."
        for order, count in enumerate(counts):
            if order >= min_order and count.isdigit():
                total += int(count) * (BASE_PAGE << order)
    return total


def read_facts(root: Path = THP_DIR) -> ThpFacts:
    hugepage = _read_int(root / "hpage_pmd_size") or 2 << 20
    order = (hugepage // BASE_PAGE).bit_length() - 1
    return ThpFacts(
        enabled=bracketed(root / "enabled"),
        shmem_enabled=bracketed(root / "shmem_enabled"),
        defrag=bracketed(root / "defrag"),
        hugepage_bytes=hugepage,
        reporting_order=reporting_order(),
        free_hugepage_bytes=free_block_bytes(order),
    )
