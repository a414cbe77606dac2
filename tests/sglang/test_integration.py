"""hostpool.integrations.sglang against the real, pinned sglang 0.5.23 (issue 15)."""

from __future__ import annotations

import gc
import json
import mmap
import multiprocessing
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

import hostpool
from hostpool.core.ledger import get_ledger
from hostpool.integrations import sglang as integration
from hostpool.metrics import measure
from tests import helpers
from tests.sglang import pools
from tests.sglang.cpu_import import load_sglang

ROOT = Path(__file__).resolve().parents[2]
PAGE = mmap.PAGESIZE
COMMON = "sglang.srt.mem_cache.pool_host.common"


def _identities() -> dict[tuple[str, str], int]:
    """id() of every attribute of every loaded sglang module."""
    out = {}
    for name, module in list(sys.modules.items()):
        if integration.is_sglang(name) and isinstance(module, types.ModuleType):
            for attr, value in list(vars(module).items()):
                out[(name, attr)] = id(value)
    return out


@pytest.fixture(scope="module")
def sglang() -> Iterator[dict[tuple[str, str], int]]:
    """sglang loaded unpatched (its originals recorded), then the integration installed."""
    was = integration.installed()
    integration.uninstall()
    load_sglang()
    before = _identities()
    integration.install()
    yield before
    if not was:
        integration.uninstall()


def _pool_bytes(pool: str) -> int:
    samples = measure(get_ledger())["hostpool_allocated_bytes"]
    return int(sum(v for labels, v in samples.items() if labels[0] == pool))


def _releases(pool: str) -> dict[str, int]:
    get_ledger().drain()
    return {how: n for (p, how), n in get_ledger().releases_total.items() if p == pool}


def _records(pool: str) -> list[Any]:
    return [r for r in get_ledger().snapshot() if r.pool == pool]


# -- activation and patching -------------------------------------------------------------
def test_install_patches_every_module_that_imported_the_originals(sglang: Any) -> None:
    common = sys.modules[COMMON]
    factory = common.get_allocator_from_storage
    assert factory.__module__.startswith(integration.__name__)
    original = factory.__wrapped__
    # Every sglang module that imported the factory by name now holds the replacement.
    holders = [
        name
        for name, module in list(sys.modules.items())
        if integration.is_sglang(name)
        and isinstance(module, types.ModuleType)
        and "get_allocator_from_storage" in vars(module)
    ]
    assert {
        "sglang.srt.mem_cache.pool_host.base",
        "sglang.srt.mem_cache.pool_host.mha",
        "sglang.srt.mem_cache.pool_host.mamba",
        "sglang.srt.mem_cache.memory_pool_host",
    } <= set(holders)
    for name in holders:
        assert sys.modules[name].get_allocator_from_storage is factory, name
    leftovers = [
        (name, attr)
        for name, module in list(sys.modules.items())
        if integration.is_sglang(name) and isinstance(module, types.ModuleType)
        for attr, value in list(vars(module).items())
        if value is original
    ]
    assert leftovers == []


def test_a_module_imported_later_gets_the_replacements(sglang: Any, tmp_path: Path) -> None:
    import sglang as package

    (tmp_path / "hostpool_probe_late.py").write_text(
        "from sglang.srt.mem_cache.pool_host.common import get_allocator_from_storage\n"
        "from sglang.srt.mem_cache.storage.mmap.mmap_allocator import alloc_shm\n"
    )
    package.__path__.append(str(tmp_path))
    try:
        import sglang.hostpool_probe_late as probe  # type: ignore[import-not-found]

        assert probe.get_allocator_from_storage.__module__.startswith(integration.__name__)
        assert probe.alloc_shm.__module__.startswith(integration.__name__)
    finally:
        package.__path__.remove(str(tmp_path))
        sys.modules.pop("sglang.hostpool_probe_late", None)


def test_install_twice_is_a_no_op_and_uninstall_restores_sglang_exactly(sglang: Any) -> None:
    before = sglang
    integration.install()
    patched = _identities()
    integration.install()
    assert _identities() == patched
    integration.uninstall()
    try:
        after = _identities()
        changed = {k for k in before if k in after and after[k] != before[k]}
        assert changed == set()
        common = sys.modules[COMMON]
        assert common.get_allocator_from_storage.__module__ == COMMON
    finally:
        integration.install()
    assert _identities() == patched


# -- real host pools -----------------------------------------------------------------------
KINDS = [
    "mha:layer_first",
    "mha:page_first",
    "mha:page_first_direct",
    "mha:page_head",
    "mla:layer_first",
    "mla:page_first",
    "mla:page_first_direct",
    "mla_split",
    "mamba",
]


def _label(kind: str) -> str:
    return "mamba" if kind == "mamba" else kind.replace(":", "_")


@pytest.mark.parametrize("kind", KINDS)
def test_host_pool_on_memfds_under_its_label(sglang: Any, kind: str, no_leaked_fds: None) -> None:
    label = _label(kind)
    before = _pool_bytes(label)
    released_before = _releases(label).get("explicit", 0)
    pool = pools.build(kind, "shm", label)
    bufs = pools.buffers(pool)
    asked = sum(b.numel() * b.element_size() for b in bufs)
    records = _records(label)
    assert [r.backend for r in records] == ["memfd"] * len(bufs)
    assert all(r.name.startswith(f"hostpool.{label}.") for r in records)
    assert [r.requested_bytes for r in records] == [b.numel() * b.element_size() for b in bufs]
    # The gauge moves by what was mapped: exactly the bytes sglang asked for, in pages.
    assert [r.mapped_bytes for r in records] == [
        -(-r.requested_bytes // PAGE) * PAGE for r in records
    ]
    assert _pool_bytes(label) - before == sum(r.mapped_bytes for r in records)
    assert sum(r.requested_bytes for r in records) == asked
    # sglang's fd is the first of its fds and names the first buffer's memfd.
    assert pool.allocator.fd == pool.allocator.fds[0] == records[0].fd
    assert [r.fd for r in records] == pool.allocator.fds
    assert os.readlink(f"/proc/self/fd/{records[0].fd}") == f"/memfd:{records[0].name} (deleted)"

    # A page written through sglang's own API (the split MLA layout has none on CPU:
    # written through its host buffer) is in the memfds.
    try:
        dummy = pool.get_dummy_flat_data_page()
        page = (torch.arange(dummy.numel()) % 251 + 1).to(dummy.dtype)
        pool.set_from_flat_data_page(1, page)
        assert torch.equal(pool.get_data_page(1).flatten(), page)
        written = int(page.view(torch.uint8).count_nonzero())
    except ValueError:
        assert kind == "mla_split"
        bufs[0][1].fill_(1.0)
        written = int(bufs[0][1].contiguous().view(torch.uint8).count_nonzero())
    nonzero = 0
    for buf, record in zip(bufs, records, strict=True):
        with mmap.mmap(record.fd, record.mapped_bytes, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            seen = torch.frombuffer(bytearray(mm), dtype=torch.uint8)
        assert torch.equal(
            seen[: buf.numel() * buf.element_size()], buf.flatten().view(torch.uint8)
        )
        nonzero += int(seen.count_nonzero())
    assert nonzero == written

    addresses = [(r.address, r.mapped_bytes) for r in records]
    pool.destroy()
    del pool, bufs, records, seen, buf, record
    gc.collect()
    assert _records(label) == []
    assert _pool_bytes(label) == before
    released = _releases(label)
    assert released.get("explicit", 0) - released_before == len(addresses)
    assert "finalizer" not in released
    for address, length in addresses:
        assert not helpers.range_mapped(address, length)


def test_default_allocator_is_tracked_too(sglang: Any, no_leaked_fds: None) -> None:
    pool = pools.mha("layer_first", "default", "mha_default")
    asked = sum(b.numel() * b.element_size() for b in pools.buffers(pool))
    records = _records("mha_default")
    assert [r.backend for r in records] == ["anon"]
    assert records[0].requested_bytes == asked
    pool.destroy()
    del pool
    gc.collect()
    assert _records("mha_default") == []
    assert _releases("mha_default") == {"explicit": 1}


def test_dropping_a_pool_without_destroy_is_a_finalizer_release_through_the_ledger(
    sglang: Any, no_leaked_fds: None
) -> None:
    """Issue 16 point 5: sglang's `__del__` closed region fds behind the ledger's back,
    leaving regions live with fd=None and no release counted."""
    pool = pools.mha("layer_first", "shm", "mha_dropped")
    allocator = pool.allocator
    (fd,) = allocator.fds
    skips = sum(get_ledger().fd_reuse_skips.values())
    with structlog.testing.capture_logs() as logs:
        del pool, allocator
        gc.collect()
        assert _records("mha_dropped") == []
        assert _releases("mha_dropped") == {"finalizer": 1}
    # The ledger closed its own fd: nobody closed it behind its back first.
    assert sum(get_ledger().fd_reuse_skips.values()) == skips
    assert [e for e in logs if "reuse" in e["event"]] == []
    with pytest.raises(OSError):
        os.fstat(fd)


def test_alloc_shm_replacement_hands_the_caller_its_own_fd(
    sglang: Any, no_leaked_fds: None
) -> None:
    from sglang.srt.mem_cache.storage.mmap import alloc_shm

    tensor, fd, mm = alloc_shm((1024,), torch.float32)
    try:
        assert [r.fd for r in _records("default") if r.fd == fd] == []  # a dup, not ours
        os.pwrite(fd, b"\x01\x00\x00\x00", 0)
        assert tensor[0].view(torch.int32).item() == 1
    finally:
        os.close(fd)
        mm.close()
        del tensor


@pytest.mark.parametrize(
    "allocator_type", [None, "", "default", "shm", "mooncake", "mori", "tensorcast", "file", 3]
)
def test_get_allocator_from_storage_answers_like_sglang(sglang: Any, allocator_type: Any) -> None:
    """Same dispatch, fallbacks and errors (mori is not installed: sglang falls back to
    its default; tensorcast needs sglang's runtime config: it raises). Where sglang picks
    one of its own two classes, hostpool's stand-in for it; any other stays sglang's."""
    common = sys.modules[COMMON]
    ours = common.get_allocator_from_storage
    try:
        theirs = ours.__wrapped__(allocator_type)
    except Exception as exc:
        with pytest.raises(type(exc)):
            ours(allocator_type)
        return
    got = ours(allocator_type)
    stand_in = {common.HostTensorAllocator: "mmap", common.ShmHostTensorAllocator: "shm"}
    if type(theirs) in stand_in:
        assert got.hostpool_kind == stand_in[type(theirs)]
        assert type(got).__module__.startswith(integration.__name__)
    else:
        assert type(got) is type(theirs)
    assert isinstance(got, sglang_base_allocator())


# -- get_allocator_type: sglang's answers -------------------------------------------------
EXTRA_CONFIGS = [
    None,
    "",
    '{"allocator": "shm"}',
    '{"allocator": "default"}',
    '{"allocator": 3}',
    "[1, 2]",
    "not json",
    '"shm"',
    "null",
    "{",
]
BACKENDS = [None, "", "shm", "dynamic", "mooncake", "file", "nixl"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", EXTRA_CONFIGS)
def test_get_allocator_type_answers_like_sglang(sglang: Any, backend: Any, extra: Any) -> None:
    from sglang.srt import runtime_context

    common = sys.modules[COMMON]
    ours = common.get_allocator_type
    original = ours.__wrapped__
    memory = types.SimpleNamespace(
        hicache_storage_backend=backend, hicache_storage_backend_extra_config=extra
    )
    saved = runtime_context.get_memory
    common.get_memory = lambda: memory
    try:
        expected = original()
        with structlog.testing.capture_logs() as logs:
            assert ours() == expected
        assert ours(memory) == expected
        assert ours(vars(memory)) == expected
        # hostpool's own API: the same rule, the same answers (issue 26 point 7).
        with structlog.testing.capture_logs() as top_logs:
            assert hostpool.get_allocator_type(memory) == expected
    finally:
        common.get_memory = saved
    malformed = extra in ("not json", "[1, 2]", '"shm"', "null", "{")
    for captured in (logs, top_logs):
        bad = [e for e in captured if e["event"] == "hostpool.sglang.bad_extra_config"]
        assert len(bad) == (1 if backend == "dynamic" and malformed else 0)


def test_an_extra_config_file_is_read_by_hostpools_api_not_by_sglangs_rule(
    sglang: Any, tmp_path: Path
) -> None:
    """sglang 0.5.23's `get_allocator_type` reads only inline JSON: `@file` asking for shm
    gets "dynamic" there (its default allocator), and the warning says so; hostpool's own
    `get_allocator_type` reads the file (DESIGN layer 3)."""
    from sglang.srt import runtime_context

    path = tmp_path / "extra.json"
    path.write_text('{"allocator": "shm"}')
    memory = types.SimpleNamespace(
        hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=f"@{path}"
    )
    common = sys.modules[COMMON]
    saved = runtime_context.get_memory
    common.get_memory = lambda: memory
    try:
        assert common.get_allocator_type.__wrapped__() == "dynamic"
        with structlog.testing.capture_logs() as logs:
            assert common.get_allocator_type() == "dynamic"
    finally:
        common.get_memory = saved
    (event,) = [e for e in logs if e["event"] == "hostpool.sglang.bad_extra_config"]
    assert str(path) in event["error"] and "inline JSON" in event["error"]
    assert hostpool.get_allocator_type(memory) == "shm"


# -- foreign allocators --------------------------------------------------------------------
SGLANG_BASE = f"{COMMON}.HostTensorAllocator"
MOONCAKE_CLASS = (
    "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store.MooncakeHostTensorAllocator"
)


@pytest.mark.parametrize("activation", ["env", "install"])
def test_foreign_allocators_imported_after_install_keep_sglangs_base_and_are_recorded(
    activation: str,
) -> None:
    """Issue 26 point 3. sglang imports mooncake's, UMBP's and tensorcast's allocator
    classes lazily, after the integration is on: they must inherit sglang's own base class
    (while installed and after uninstall), and the real mooncake allocator's tensor (its
    memfd `mooncake_shm`) is a foreign record of the pool, released by `destroy()`. A
    fresh process: nothing there imported those classes before the integration."""
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    if activation == "env":
        env["HOSTPOOL_INSTRUMENT"] = "sglang"
    out = subprocess.run(
        [sys.executable, "-m", "tests.sglang.foreign_child", activation],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "hostpool/" not in out.stderr, out.stderr[-4000:]  # no traceback of ours
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["installed"] is True
    assert got["imported_before"] == []
    assert got["base"] == SGLANG_BASE
    assert got["allocator_class"] == MOONCAKE_CLASS
    every = {"mooncake": SGLANG_BASE, "umbp": SGLANG_BASE, "tensorcast": SGLANG_BASE}
    assert got["bases_while_installed"] == every
    # The real mooncake library mapped it; hostpool describes it (no fd of its own).
    assert got["buffer_mapping"] == "/memfd:mooncake_shm"
    assert got["records"] == [
        {"backend": "foreign", "allocator": "mooncake", "fd": None,
         "address": got["buffer_address"]}
    ]  # fmt: skip
    assert got["gauge"] == got["buffer_bytes"] > 0
    # Without mori, sglang falls back to its own default allocator: hostpool's stand-in.
    assert got["mori_fallback_tracked"] == "mmap"
    assert got["records_after_destroy"] == 0
    assert got["releases"] == {"explicit": 1}
    assert got["base_after_uninstall"] == SGLANG_BASE
    assert got["bases_after_uninstall"] == every


def test_rocm_host_memory_check_answers_for_hostpools_default_as_for_sglangs(
    sglang: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sglang allocates ROCm host pools of its own default allocator with hipHostMalloc
    (`type(allocator) is HostTensorAllocator`); hostpool's stand-in keeps that answer."""
    common = sys.modules[COMMON]
    monkeypatch.setattr(common, "_is_hip", True)
    monkeypatch.setenv("HSA_USERPTR_FOR_PAGED_MEM", "0")
    check = common._uses_hip_owned_host_memory
    original = check.__wrapped__
    ours = common.get_allocator_from_storage("default")
    assert ours.hostpool_kind == "mmap"
    assert original(pin_memory=True, allocator=sglang_base_allocator()()) is True
    assert check(pin_memory=True, allocator=ours) is True
    assert check(pin_memory=False, allocator=ours) is False
    # sglang's shm allocator owns its backing (memfds): neither it nor hostpool's is.
    assert original(pin_memory=True, allocator=common.ShmHostTensorAllocator()) is False
    assert check(pin_memory=True, allocator=common.get_allocator_from_storage("shm")) is False


def sglang_base_allocator() -> type:
    """sglang's own base allocator class: install() leaves its name alone in `common`."""
    base = sys.modules[COMMON].HostTensorAllocator
    assert f"{base.__module__}.{base.__qualname__}" == SGLANG_BASE
    return base  # type: ignore[no-any-return]


# -- a spawned child, activated by the environment alone ----------------------------------
def _spawn(env: dict[str, str], label: str) -> tuple[Any, Any, dict[str, Any]]:
    from tests.sglang.child import build_pool_and_wait

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        process = ctx.Process(target=build_pool_and_wait, args=(child, label))
        process.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if not parent.poll(120):
        process.kill()
        raise AssertionError("the spawned child did not report in 120 s")
    return process, parent, parent.recv()


def _dashboard_server_series() -> set[str]:
    from tests import dashboard_lint as lint

    names: set[str] = set()
    for _, expr in lint.panel_exprs(lint.load_dashboard()):
        names |= lint.metric_names(expr)
    # Not an engine's series: hostpool_exporter_* and hostpool_host_* come from `hostpool
    # exporter` (--node), hostpool_serve_* from `hostpool serve`, hostpool_vllm_* from the
    # vLLM metrics route only, hostpool_broker_* from `hostpool serve` as the broker.
    others = (
        "hostpool_exporter_",
        "hostpool_host_",
        "hostpool_serve_",
        "hostpool_vllm_",
        "hostpool_broker_",
    )
    return {n for n in names if n.startswith("hostpool_") and not n.startswith(others)}


@pytest.mark.slow
def test_spawned_child_with_the_variable_is_tracked_in_inspect_and_metrics(
    sglang: Any, tmp_path: Path
) -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {"HOSTPOOL_INSTRUMENT": "sglang", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    process, conn, info = _spawn(env, "spawned_kv")
    try:
        assert info["patched"] is True
        out = subprocess.run(
            [sys.executable, "-m", "hostpool", "inspect", str(info["pid"]), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        by_pool = {p["pool"]: p for p in report["pools"]}
        assert "spawned_kv" in by_pool, report["pools"]
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
        value = registry.get_sample_value(
            "hostpool_allocated_bytes",
            {"pool": "spawned_kv", "allocator": "shm", "page_size": "4KiB"},
        )
        assert value == info["bytes"], [
            s for m in registry.collect() for s in m.samples if "allocated" in s.name
        ]
        # The dashboards work against sglang's job unchanged: every hostpool series they
        # query for a server (not the exporter's) is among sglang's multiprocess samples.
        served = {s.name for m in registry.collect() for s in m.samples}
        assert _dashboard_server_series() - served == set()
    finally:
        conn.send("go")
        conn.poll(60)
        process.join(60)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0


@pytest.mark.slow
def test_spawned_child_without_the_variable_leaves_sglang_untouched(sglang: Any) -> None:
    env = {"HOSTPOOL_INSTRUMENT": ""}
    process, conn, info = _spawn(env, "untouched_kv")
    conn.send("go")
    conn.poll(60)
    process.join(60)
    assert info["patched"] is False
    assert process.exitcode == 0


def test_sglang_hugepage_size_gives_the_default_pool_hugetlb_pages(
    sglang: Any, hugepages_2m: int, monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    """sglang's SGLANG_HUGEPAGE_SIZE=2MB maps its default host pools on hugetlb pages."""
    monkeypatch.setenv("SGLANG_HUGEPAGE_SIZE", "2MB")
    pool = pools.mha("layer_first", "default", "mha_huge")
    (record,) = _records("mha_huge")
    assert record.page_size == 2 << 20
    assert record.mapped_bytes % (2 << 20) == 0
    pool.destroy()
    del pool
    gc.collect()
    assert _records("mha_huge") == []


def test_an_unknown_sglang_hugepage_size_warns_and_uses_normal_pages(
    sglang: Any, monkeypatch: pytest.MonkeyPatch, no_leaked_fds: None
) -> None:
    monkeypatch.setenv("SGLANG_HUGEPAGE_SIZE", "3MB")
    with structlog.testing.capture_logs() as logs:
        pool = pools.mha("layer_first", "default", "mha_odd")
    (record,) = _records("mha_odd")
    assert record.page_size == PAGE
    assert [e["value"] for e in logs if e["event"] == "hostpool.sglang.bad_hugepage_size"] == [
        "3MB"
    ]
    pool.destroy()
    del pool
    gc.collect()
