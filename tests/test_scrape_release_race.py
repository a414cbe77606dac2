"""A scrape racing a release: measuring a region never keeps it mapped.

The collector (`hostpool.metrics.measure`, also run by the multiprocess publisher and the
vLLM route's publishing thread) measures each region on its own thread while the owner
may be releasing it. Each test pauses a scrape in the middle of measuring one region
(inside its `fstat` for fd-backed regions, inside `mincore` for anonymous and torch ones,
by a monkeypatch that waits on an Event), then releases and drops the region on the main
thread. The release must see only the owner's views: the pages go with the owner's last
reference, the region ends once and as what it was (`explicit` or `tensor`), and nothing is
"released, still mapped", in a leak report, or in a `hostpool.leak` event.

Before the fix the scrape held the region's mmap object (or, for torch regions, its buffer
holder) while it measured: the owner's `del tensor` left the mapping alive in the scrape's
hands, so `manager.close()` reported a leak and the gauge showed released-mapped bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from hostpool import HostPoolManager
from hostpool.core.ledger import get_ledger
from hostpool.memory import syscalls
from hostpool.memory.region import Region
from hostpool.metrics import measure
from tests import helpers
from tests.waiting import DEADLINE

MiB = 1 << 20
KINDS = ("shm", "mmap", "default")


@dataclass
class PausedScrape:
    """A `measure()` on its own thread, paused while it measures one region."""

    thread: threading.Thread
    paused: threading.Event = field(default_factory=threading.Event)
    resume: threading.Event = field(default_factory=threading.Event)
    result: dict[str, dict[tuple[str, ...], Any]] = field(default_factory=dict)
    error: list[BaseException] = field(default_factory=list)

    def finish(self) -> dict[str, dict[tuple[str, ...], Any]]:
        self.resume.set()
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive(), "the scrape did not finish"
        assert not self.error, self.error
        return self.result


@pytest.fixture
def pause_scrape(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Region], PausedScrape]]:
    """Start a scrape that stops inside the measurement of `region` until resumed."""
    started: list[PausedScrape] = []

    def start(region: Region) -> PausedScrape:
        def run() -> None:
            try:
                scrape.result.update(measure(get_ledger()))
            except BaseException as exc:  # reported by finish()
                scrape.error.append(exc)

        scrape = PausedScrape(threading.Thread(target=run, name="paused-scrape"))

        def pause_here() -> None:
            if threading.current_thread() is scrape.thread and not scrape.paused.is_set():
                scrape.paused.set()
                assert scrape.resume.wait(DEADLINE)

        real_fstat = os.fstat
        real_mincore = syscalls.mincore_resident_pages

        def fstat(fd: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            st = real_fstat(fd, *args, **kwargs)
            if (st.st_dev, st.st_ino) == region.facts.dev_ino:
                pause_here()  # the fd-backed measurement: its own fd, fstat-ed
            return st

        def mincore(address: int, length: int) -> int:
            if address <= region.facts.address < address + length:
                pause_here()  # the anonymous measurement: mincore over the range
            return real_mincore(address, length)

        monkeypatch.setattr(os, "fstat", fstat)
        monkeypatch.setattr(syscalls, "mincore_resident_pages", mincore)
        scrape.thread.start()
        started.append(scrape)
        assert scrape.paused.wait(DEADLINE), "the scrape never reached the region"
        return scrape

    yield start
    for scrape in started:  # a failed test must not leave the thread waiting
        scrape.resume.set()
        scrape.thread.join(DEADLINE)


def _allocate(pool: str, kind: str) -> tuple[HostPoolManager, torch.Tensor, Region]:
    manager = HostPoolManager()
    allocator = manager.allocator(pool, kind)
    tensor = allocator.allocate((2 * MiB,), torch.uint8)
    (region,) = allocator.regions
    return manager, tensor, region


def _releases(pool: str) -> dict[str, int]:
    counts = get_ledger().counters().releases_total
    return {how: counts.get((pool, how), 0) for how in ("explicit", "tensor", "finalizer")}


def _assert_gone(region: Region) -> None:
    """The region left the ledger and, for hostpool's own mappings, the address space."""
    ledger = get_ledger()
    ledger.drain()
    assert region.facts.id not in {e.region.facts.id for e in ledger.entries()}
    assert not region.mapped
    assert region.fd is None
    if region.facts.name is not None and region.facts.kind == "shm":
        assert helpers.maps_lines(region.facts.name) == []
        assert region.facts.name not in "".join(helpers.fd_links().values())
    elif region.facts.kind == "mmap":
        assert not helpers.range_mapped(region.facts.address, region.facts.mapped_bytes)


@pytest.mark.parametrize("kind", KINDS)
def test_release_during_a_scrape_sees_only_the_owners_views(
    kind: str, pause_scrape: Callable[[Region], PausedScrape]
) -> None:
    """The vLLM worker's sequence: release(tensor) while holding it, drop it, close the
    manager, all while a scrape is measuring the region."""
    pool = f"race-release-{kind}"
    manager, tensor, region = _allocate(pool, kind)
    scrape = pause_scrape(region)
    with capture_logs() as logs:
        assert manager.allocator(pool, kind).release(tensor) is False  # our view lives
        del tensor  # the last view: the pages go now, whoever is measuring
        report = manager.close()
    assert not report, str(report)
    assert [e for e in logs if e["event"] == "hostpool.leak"] == []
    (release,) = [e for e in logs if e["event"] == "hostpool.release"]
    assert release["how"] == "explicit"
    _assert_gone(region)
    assert _releases(pool) == {"explicit": 1, "tensor": 0, "finalizer": 0}
    # Another scrape meanwhile sees nothing released-but-mapped.
    assert measure(get_ledger())["hostpool_released_mapped_bytes"][(pool,)] == 0.0
    paused = scrape.finish()
    if kind != "shm":
        # mincore ran after the range went away: the region counts nothing (never pages
        # of whatever the kernel mapped there since).
        assert sum(v for k, v in paused["hostpool_resident_bytes"].items() if k[0] == pool) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_dropped_during_a_scrape_ends_with_its_tensor(
    kind: str, pause_scrape: Callable[[Region], PausedScrape]
) -> None:
    """The owner drops the tensor (the region's normal end) while a scrape measures it;
    closing the manager afterwards releases nothing and reports nothing."""
    pool = f"race-drop-{kind}"
    manager, tensor, region = _allocate(pool, kind)
    scrape = pause_scrape(region)
    with capture_logs() as logs:
        del tensor
        report = manager.close()
    assert not report, str(report)
    assert [e["event"] for e in logs if e["event"] in ("hostpool.leak", "hostpool.release")] == [
        "hostpool.release"
    ]
    _assert_gone(region)
    assert _releases(pool) == {"explicit": 0, "tensor": 1, "finalizer": 0}
    scrape.finish()


@pytest.mark.parametrize("kind", ("mmap", "default"))
def test_a_range_that_goes_away_during_mincore_counts_nothing(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mincore saw the pages, then the owner's last view died before it returned: the
    count is not the region's any more (the range may hold another mapping by then)."""
    manager, tensor, region = _allocate(f"race-mincore-{kind}", kind)
    owner = [tensor]
    del tensor
    real_mincore = syscalls.mincore_resident_pages
    seen: list[int] = []

    def mincore(address: int, length: int) -> int:
        pages = real_mincore(address, length)
        seen.append(pages)
        owner.clear()  # the owner's last view dies while the measurement is in flight
        return pages

    monkeypatch.setattr(syscalls, "mincore_resident_pages", mincore)
    assert region.resident_bytes() == 0
    (pages,) = seen
    assert pages >= 2 * MiB // syscalls.PAGE_SIZE  # populated: mincore did see them all
    _assert_gone(region)
    assert not manager.close()
