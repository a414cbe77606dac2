"""The per-host transparent hugepage choice: kernel facts, the policy, and the real mapping."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hostpool import MmapHostTensorAllocator
from hostpool.memory import kernel, thp
from hostpool.memory.hugepages import thp_choice
from tests import helpers

MiB = 1 << 20
GiB = 1 << 30

BARE_METAL = thp.ThpFacts(
    enabled="madvise",
    shmem_enabled="advise",
    defrag="madvise",
    hugepage_bytes=2 * MiB,
    reporting_order=None,
    free_hugepage_bytes=8 * GiB,
)


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_facts_are_this_hosts_settings() -> None:
    facts = thp.read_facts()
    assert facts.enabled == kernel.anon_thp_mode()
    assert facts.shmem_enabled == kernel.shmem_thp_mode()
    defrag = Path("/sys/kernel/mm/transparent_hugepage/defrag").read_text()
    assert f"[{facts.defrag}]" in defrag
    order = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    if order.exists() and 0 <= int(order.read_text()) <= 20:
        assert facts.reporting_order == int(order.read_text())
    else:
        assert facts.reporting_order is None
    assert facts.hugepage_order == 9 or facts.hugepage_bytes != 2 * MiB
    assert 0 <= facts.free_hugepage_bytes <= kernel.meminfo()["MemFree"]


def test_free_blocks_count_only_hugepage_order_and_up(tmp_path: Path) -> None:
    buddy = tmp_path / "buddyinfo"
    # orders 0..10; 3 blocks of order 9 (2 MiB) and 2 of order 10 (4 MiB) in two zones
    buddy.write_text(
        "Node 0, zone    DMA32   7 7 7 7 7 7 7 7 7 1 2\n"
        "Node 0, zone   Normal   9 9 9 9 9 9 9 9 9 2 0\n"
    )
    assert thp.free_block_bytes(9, buddy) == 3 * 2 * MiB + 2 * 4 * MiB
    assert thp.free_block_bytes(9, tmp_path / "missing") == 0


def test_reporting_order_unregistered_reads_as_none(tmp_path: Path) -> None:
    param = tmp_path / "page_reporting_order"
    param.write_text("4294967295\n")  # -1 until a balloon registers
    assert thp.reporting_order(param) is None
    param.write_text("9\n")
    assert thp.reporting_order(param) == 9


@pytest.mark.parametrize(
    ("facts", "kind", "advise", "avoid", "reason"),
    [
        (BARE_METAL, "mmap", True, False, None),
        (replace(BARE_METAL, enabled="never"), "mmap", False, False, "thp_disabled"),
        (replace(BARE_METAL, shmem_enabled="never"), "shm", False, False, "thp_disabled"),
        (BARE_METAL, "torch", False, False, "thp_disabled"),
        # a VM whose balloon takes free 2 MiB blocks back
        (replace(BARE_METAL, reporting_order=9), "mmap", False, False, "thp_costly"),
        (
            replace(BARE_METAL, reporting_order=9, enabled="always"),
            "mmap",
            False,
            True,
            "thp_costly",
        ),
        # reporting only 4 MiB blocks and up leaves 2 MiB blocks with the guest
        (replace(BARE_METAL, reporting_order=10), "mmap", True, False, None),
        # direct compaction ahead: free 2 MiB blocks short of the request
        (replace(BARE_METAL, free_hugepage_bytes=GiB), "mmap", False, False, "thp_costly"),
        # ... but `defer` never stalls the fault: worth asking
        (replace(BARE_METAL, free_hugepage_bytes=GiB, defrag="defer"), "mmap", True, False, None),
    ],
)
def test_choice(
    facts: thp.ThpFacts, kind: str, advise: bool, avoid: bool, reason: str | None
) -> None:
    choice = thp_choice(kind, 4 * GiB, facts)  # type: ignore[arg-type]
    assert (choice.advise, choice.avoid, choice.reason) == (advise, avoid, reason)
    assert choice.why


def test_mmap_prefer_takes_this_hosts_choice(no_leaked_fds: None) -> None:
    """No 1 GiB hugetlb pages are reserved here, so `prefer` reaches the THP step, and the
    mapping carries what the choice says: VmFlags `hg` (MADV_HUGEPAGE), `nh`, or neither."""
    if kernel.hugepage_pool(GiB) is not None and kernel.hugepage_pool(GiB).available:  # type: ignore[union-attr]
        pytest.skip("1 GiB hugetlb pages are reserved on this host")
    choice = thp_choice("mmap", 4 * MiB, thp.read_facts())
    alloc = MmapHostTensorAllocator("thp", hugepages="prefer", hugepage_size="1GB")
    t = alloc.allocate((4 * MiB,), torch.uint8)
    region = alloc.regions[0]
    assert region.facts.thp_advised == choice.advise
    expected = ("hugetlb_pool_short",) + (() if choice.advise else (choice.reason,))
    assert region.facts.hugepage_fallbacks == expected
    flags = _vm_flags(region.facts.address)
    assert ("hg" in flags) == choice.advise
    assert ("nh" in flags) == choice.avoid
    alloc.close()
    del t


def test_doctor_explains_the_choice() -> None:
    """`hostpool doctor` shows the allocators' own choice for both kinds, with the cause."""
    need = 256 * MiB
    facts = thp.read_facts()
    proc = helpers.run_python(
        "from hostpool.cli import main; raise SystemExit(main(['doctor', '--json', "
        "'--hugepages', 'off', '--need', '256MiB']))"
    )
    report = json.loads(proc.stdout)
    for kind in ("shm", "mmap"):
        choice = thp_choice(kind, need, facts)  # type: ignore[arg-type]
        shown = report["plan"]["thp_choice"][kind]
        assert (shown["advise"], shown["reason"], shown["why"]) == (
            choice.advise,
            choice.reason,
            choice.why,
        )
    assert report["host"]["thp"]["defrag"] == facts.defrag
    text = helpers.run_python(
        "from hostpool.cli import main; raise SystemExit(main(['doctor', '--hugepages', 'off', "
        "'--need', '256MiB']))"
    ).stdout
    mmap_line = next(line for line in text.splitlines() if line.startswith("THP for mmap"))
    assert thp_choice("mmap", need, facts).why in mmap_line
