"""/debug/pools for people and tools: seal names, ISO-8601 UTC times, hex addresses, and
resident bytes per region and per pool, in process and from a real `hostpool serve`."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hostpool.core.manager import PoolManager
from hostpool.serve.debugdoc import POOL_FIGURES, debug_document, iso_utc, seal_names
from tests.test_serve import start_serve


def _parse_iso(text: str) -> datetime.datetime:
    assert text.endswith("Z"), text
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_seal_names() -> None:
    assert seal_names(0) == []
    mask = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    assert seal_names(mask) == ["seal", "shrink", "grow"]
    assert seal_names(fcntl.F_SEAL_WRITE | 0x10 | 0x20) == ["write", "future_write", "exec"]
    assert seal_names(0x40 | fcntl.F_SEAL_SEAL) == ["seal", "0x40"]
    with pytest.raises(ValueError, match="negative"):
        seal_names(-1)


def test_iso_utc() -> None:
    assert iso_utc(0) == "1970-01-01T00:00:00.000Z"
    assert iso_utc(1.5) == "1970-01-01T00:00:01.500Z"


@pytest.fixture
def manager() -> Iterator[PoolManager]:
    m = PoolManager()
    yield m
    m.close()


def test_document_in_process(manager: PoolManager) -> None:
    started = time.time()
    full = manager.allocator("dbg_full", "shm").allocate((4 << 20,), torch.uint8)
    lazy = manager.allocator("dbg_lazy", "mmap", populate="none").allocate((8 << 20,), torch.uint8)
    lazy[0] = 1  # one page (or one huge page) of eight MiB is resident
    doc: dict[str, Any] = json.loads(json.dumps(debug_document(manager, started)))
    assert doc["pid"] == os.getpid()
    assert _parse_iso(doc["started_at"]).timestamp() == pytest.approx(started, abs=0.001)
    assert _parse_iso(doc["generated_at"]) >= _parse_iso(doc["started_at"])
    assert doc["uptime_seconds"] >= 0
    by_pool = {r["pool"]: r for r in doc["regions"]}
    shm, anon = by_pool["dbg_full"], by_pool["dbg_lazy"]
    assert int(shm["address"], 16) == full.data_ptr() and shm["address"].startswith("0x")
    assert int(anon["address"], 16) == lazy.data_ptr()
    assert {"seal", "shrink", "grow"} <= set(shm["seals"]) and anon["seals"] == []
    created = _parse_iso(shm["created_at"]).timestamp()
    assert started - 0.001 <= created <= _parse_iso(doc["generated_at"]).timestamp() + 0.001
    # Resident: the populated memfd whole (fstat st_blocks), the lazy mapping in part.
    assert shm["resident_bytes"] == 4 << 20
    assert 0 < anon["resident_bytes"] < 8 << 20
    pools = doc["pools"]
    assert pools["dbg_full"]["resident_bytes"] == 4 << 20
    assert pools["dbg_lazy"]["resident_bytes"] == anon["resident_bytes"]
    assert pools["dbg_lazy"]["bytes"] == 8 << 20
    for key in POOL_FIGURES:
        assert doc["totals"][key] == sum(p[key] for p in pools.values())
    assert doc["totals"]["bytes"] == 12 << 20
    del full, lazy


def test_released_region_still_mapped_is_not_counted_resident(manager: PoolManager) -> None:
    alloc = manager.allocator("dbg_rel", "shm")
    t = alloc.allocate((1 << 20,), torch.uint8)
    alloc.release(t)  # t still maps it: released, still mapped
    doc = debug_document(manager, time.time())
    (region,) = [r for r in doc["regions"] if r["pool"] == "dbg_rel"]
    assert region["state"] == "released_mapped"
    assert doc["pools"]["dbg_rel"]["released_mapped_bytes"] == 1 << 20
    assert doc["pools"]["dbg_rel"]["resident_bytes"] == 0  # live regions only, as metrics
    del t


def test_served_document(tmp_path: os.PathLike[str]) -> None:
    served = start_serve(tmp_path)
    try:
        status, body = served.get("/debug/pools")
        assert status == 200, body
        doc = json.loads(body)
        assert served.stop() == 0
    finally:
        served.kill()
    assert doc["pid"] == served.proc.pid
    started = _parse_iso(doc["started_at"])
    assert started <= _parse_iso(doc["generated_at"])
    assert isinstance(doc["uptime_seconds"], float)
    # The default pools, populated at start: each resident whole.
    expected = {"kv": 64 << 20, "swa": 16 << 20, "mamba": 8 << 20}
    for pool, size in expected.items():
        assert doc["pools"][pool]["bytes"] == size
        assert doc["pools"][pool]["resident_bytes"] == size
    assert doc["totals"]["resident_bytes"] == sum(expected.values())
    for r in doc["regions"]:
        assert isinstance(r["seals"], list) and r["address"].startswith("0x"), r
        assert _parse_iso(r["created_at"]) >= started
        assert r["resident_bytes"] == r["mapped_bytes"]
    kv = next(r for r in doc["regions"] if r["pool"] == "kv")
    assert {"seal", "shrink", "grow"} <= set(kv["seals"])
