"""Structured events: names and fields, and silence for an application that configures nothing."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from structlog.testing import capture_logs

from hostpool import AllocationError, HostPoolManager, ShmHostTensorAllocator
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one(logs: list[dict[str, object]], event: str) -> dict[str, object]:
    found = [e for e in logs if e["event"] == event]
    assert found, f"no {event} in {[e['event'] for e in logs]}"
    return found[0]


def test_alloc_populate_and_release_events() -> None:
    with capture_logs() as logs:
        alloc = ShmHostTensorAllocator("ev")
        t = alloc.allocate((1 << 16,), torch.uint8)
        alloc.release(t)
        t2 = alloc.allocate((4096,), torch.uint8)
        del t2
        gc.collect()
        alloc.close()  # drains the finalizer queue
    del t
    alloc_event = _one(logs, "hostpool.alloc")
    for key in ("pool", "allocator", "bytes", "fd", "name", "seconds", "populate"):
        assert key in alloc_event
    assert alloc_event["pool"] == "ev" and alloc_event["bytes"] == 1 << 16
    assert str(alloc_event["name"]).startswith("hostpool.ev.")
    populate = _one(logs, "hostpool.populate")
    assert populate["mode"] == "madvise" and "seconds" in populate
    releases = [e for e in logs if e["event"] == "hostpool.release"]
    assert {e["how"] for e in releases} == {"explicit", "tensor"}
    assert all(e["pool"] == "ev" and "bytes" in e for e in releases)
    # The explicit release while the caller held its view unmaps with that view; the
    # tensor release (its tensor owned it) ran because the pages went.
    assert {(e["how"], e["unmap"]) for e in releases} == {
        ("explicit", "with_last_view"),
        ("tensor", "now"),
    }


def test_fallback_failure_and_leak_events(root: None) -> None:
    with helpers.reserved_hugepages(0), capture_logs() as logs:
        alloc = ShmHostTensorAllocator("evh", hugepages="prefer")
        t = alloc.allocate((4 << 20,), torch.uint8)
        with pytest.raises(AllocationError):
            ShmHostTensorAllocator("evh", hugepages="required").allocate((4096,), torch.uint8)
        manager = HostPoolManager(track_stacks=True)
        kept = manager.allocator("evleak").allocate((4096,), torch.uint8)
        manager.close()
    fallback = _one(logs, "hostpool.hugepage_fallback")
    assert fallback["reason"] == "hugetlb_pool_short" and fallback["pool"] == "evh"
    failed = _one(logs, "hostpool.alloc_failed")
    assert failed["reason"] == "hugepages" and failed["log_level"] == "warning"
    leak = _one(logs, "hostpool.leak")
    assert leak["pool"] == "evleak" and leak["bytes"] == 4096
    assert "test_fallback_failure_and_leak_events" in str(leak["stack"])
    alloc.close()
    del t, kept


def test_an_unconfigured_application_sees_no_info_events() -> None:
    proc = helpers.run_python(
        """
        import gc, torch
        from hostpool import ShmHostTensorAllocator, HostPoolManager
        a = ShmHostTensorAllocator("quiet")
        t = a.allocate((1 << 20,), torch.uint8)
        a.release(t)
        with HostPoolManager() as m:
            m.allocator("quiet2", "mmap").allocate((4096,), torch.uint8)
        gc.collect()
        print("done")
        """,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    assert "hostpool.alloc" not in proc.stderr and "hostpool.release" not in proc.stderr


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_cli_log_carries_hostpool_events_only(fmt: str) -> None:
    """Other libraries' info lines (torch's FakeTensor cache stats at exit) stay out of
    the `hostpool` command's log; --log-format picks the rendering."""
    proc = helpers.run_python(
        f"""
        import logging
        from hostpool.cli.logsetup import configure_logging
        from hostpool.base import events
        configure_logging("info", "{fmt}")
        logging.getLogger("torch._subclasses.fake_tensor").info("FakeTensor cache stats:")
        events.info("hostpool.demo_event", pool="kv")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "FakeTensor" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "hostpool.demo_event" in lines[0]
    assert lines[0].startswith("{") == (fmt == "json")
