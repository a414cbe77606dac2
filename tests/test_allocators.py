"""Allocators: ownership, close under live views, bad inputs, get_allocator_type."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import structlog
import torch

import hostpool
from hostpool import (
    ConfigError,
    DefaultHostTensorAllocator,
    InvalidRequestError,
    MmapHostTensorAllocator,
    ShmHostTensorAllocator,
    create_allocator,
    get_allocator_type,
    register_allocator,
)
from hostpool.core.ledger import get_ledger
from hostpool.errors import HostPoolError
from hostpool.integrations.sglang import BAD_EXTRA_CONFIG
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_close_with_live_views_does_not_crash_and_unmaps_with_last_view() -> None:
    proc = helpers.run_python(
        """
        import gc, torch
        from hostpool import ShmHostTensorAllocator, MmapHostTensorAllocator
        from tests import helpers
        for cls in (ShmHostTensorAllocator, MmapHostTensorAllocator):
            a = cls("views")
            t = a.allocate((1 << 20,), torch.uint8)
            view = t[4096:8192]
            r = a.regions[0]
            address, length = r.facts.address, r.facts.mapped_bytes
            del t
            a.close()
            a.close()                       # idempotent
            mm = r.mmap()
            if mm is not None:
                mm.close()                  # never unmaps under a live view
                del mm
            view.fill_(7)                   # still mapped: no SIGSEGV
            assert int(view.sum()) == 7 * 4096
            assert helpers.range_mapped(address, length)
            # only mmap's internal dup remains while the mapping lives (Python 3.11)
            assert len(helpers.fd_links()) == (1 if cls is ShmHostTensorAllocator else 0)
            assert r.open_fd_count() == len(helpers.fd_links())
            del view
            gc.collect()
            assert not helpers.range_mapped(address, length), cls
            assert helpers.fd_links() == {}
        print("ok")
        """,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_allocator_holds_no_memory_of_its_own(no_leaked_fds: None) -> None:
    alloc = ShmHostTensorAllocator("weak")
    tensors = [alloc.allocate((64, 1024), torch.float16) for _ in range(3)]
    assert len(alloc.fds) == 3 and len(alloc.mms) == 3
    assert alloc.fd == alloc.fds[0]  # sglang's: the first
    regions = alloc.regions
    ranges = [(r.facts.address, r.facts.mapped_bytes) for r in regions]
    del tensors, regions
    gc.collect()
    assert alloc.fds == [] and alloc.mms == [] and alloc.regions == []
    for address, length in ranges:
        assert not helpers.range_mapped(address, length)


def test_every_allocator_type_round_trips() -> None:
    for name, cls in (
        ("shm", ShmHostTensorAllocator),
        ("mmap", MmapHostTensorAllocator),
        ("default", DefaultHostTensorAllocator),
    ):
        alloc = create_allocator(name, pool="rt")
        assert isinstance(alloc, cls)
        t = alloc.allocate((2, 3, 5), torch.bfloat16)
        t.copy_(torch.arange(30, dtype=torch.bfloat16).reshape(2, 3, 5))
        assert t.dtype == torch.bfloat16 and t.shape == (2, 3, 5)
        assert float(t[1, 2, 4]) == 29.0
        alloc.close()
        del t


def test_register_allocator() -> None:
    class Tagged(ShmHostTensorAllocator):
        registered_name = "tagged"

    register_allocator("tagged", Tagged)
    alloc = create_allocator("tagged", pool="tag")
    t = alloc.allocate((16,), torch.uint8)
    assert get_ledger().snapshot(["tag"])[0].allocator == "tagged"
    alloc.close()
    del t
    with pytest.raises(InvalidRequestError):
        register_allocator("bad", dict)  # type: ignore[arg-type]


BAD_REQUESTS = [
    ((-1, 4), torch.float32, "cpu", InvalidRequestError),
    ((0, 4), torch.float32, "cpu", InvalidRequestError),
    ((True, 4), torch.float32, "cpu", InvalidRequestError),
    ((2.5, 4), torch.float32, "cpu", InvalidRequestError),
    ((), torch.float32, "cpu", InvalidRequestError),
    ("12", torch.float32, "cpu", InvalidRequestError),
    (None, torch.float32, "cpu", InvalidRequestError),
    ((1 << 40, 1 << 10), torch.float32, "cpu", InvalidRequestError),
    ((4,), "float32", "cpu", InvalidRequestError),
    ((4,), None, "cpu", InvalidRequestError),
    ((4,), torch.quint8, "cpu", InvalidRequestError),
    ((4,), torch.float32, "cuda", InvalidRequestError),
    ((4,), torch.float32, "meta", InvalidRequestError),
    ((4,), torch.float32, 3, InvalidRequestError),
]


@pytest.mark.parametrize("dims,dtype,device,error", BAD_REQUESTS)
def test_bad_requests_raise_typed_errors_and_leak_nothing(
    dims: object, dtype: object, device: object, error: type[Exception], no_leaked_fds: None
) -> None:
    alloc = ShmHostTensorAllocator("bad")
    before = get_ledger().counters().failures_total.get(("bad", "invalid"), 0)
    with pytest.raises(error):
        alloc.allocate(dims, dtype, device)  # type: ignore[arg-type]
    assert alloc.regions == []
    assert get_ledger().counters().failures_total[("bad", "invalid")] == before + 1


BAD_OPTIONS = [
    ({"hugepages": "sometimes"}, InvalidRequestError),
    ({"hugepages": "prefer", "hugepage_size": "3MB"}, InvalidRequestError),
    ({"hugepage_size": "huge"}, InvalidRequestError),
    ({"hugepage_size": -2}, InvalidRequestError),
    ({"populate": "eager"}, InvalidRequestError),
    ({"populate_threads": -1}, InvalidRequestError),
    ({"pin": "yes"}, InvalidRequestError),
    ({"numa_node": 99}, InvalidRequestError),
    ({"numa_node": -1}, InvalidRequestError),
    ({"shm_backend": "ramfs"}, InvalidRequestError),
    ({"fallback_dir": "/nonexistent/dir"}, InvalidRequestError),
    ({"colour": "blue"}, InvalidRequestError),
]


@pytest.mark.parametrize("options,error", BAD_OPTIONS)
def test_bad_options_are_rejected_up_front(
    options: dict[str, object], error: type[Exception], no_leaked_fds: None
) -> None:
    with pytest.raises(error):
        ShmHostTensorAllocator("opts", **options)


@pytest.mark.parametrize("pool", ["", "a" * 65, "kv/../x", "kv pool", "kv.1", None, 3])
def test_bad_pool_names(pool: object) -> None:
    with pytest.raises(InvalidRequestError):
        ShmHostTensorAllocator(pool)  # type: ignore[arg-type]


def test_unknown_allocator_lists_known_names() -> None:
    with pytest.raises(ConfigError, match="'default', 'mmap', 'shm'"):
        create_allocator("hbm")


def test_errors_are_one_family() -> None:
    assert issubclass(hostpool.HugepageUnavailableError, hostpool.AllocationError)
    for cls in (InvalidRequestError, ConfigError, hostpool.AllocationError):
        assert issubclass(cls, HostPoolError)


# -- get_allocator_type ---------------------------------------------------------------
@pytest.mark.parametrize(
    "args,expected",
    [
        ({}, "default"),
        ({"hicache_storage_backend": None}, "default"),
        ({"hicache_storage_backend": "shm"}, "shm"),
        ({"hicache_storage_backend": "file"}, "file"),
        ({"hicache_storage_backend": "mooncake"}, "mooncake"),
        ({"hicache_storage_backend": "dynamic"}, "dynamic"),
        (
            {
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": '{"allocator": "shm"}',
            },
            "shm",
        ),
        (
            {
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": '{"allocator": "other"}',
            },
            "dynamic",
        ),
    ],
)
def test_get_allocator_type(args: dict[str, object], expected: str) -> None:
    assert get_allocator_type(args) == expected
    assert get_allocator_type(SimpleNamespace(**args)) == expected


def _extra_config_file(directory: os.PathLike[str], name: str, text: str) -> dict[str, str]:
    """The args of sglang's dynamic backend whose extra config is `@file`: `text` written to
    `name` in `directory`."""
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(text)
    return {
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": "@" + path,
    }


@pytest.mark.parametrize(
    "suffix,text",
    [
        (".json", json.dumps({"allocator": "shm", "module_path": "x"})),
        (".toml", 'allocator = "shm"\nmodule_path = "x"\n'),
        (".yaml", "allocator: shm\nmodule_path: x\n"),
        (".yml", "allocator: shm\n"),
    ],
)
def test_extra_config_files(tmp_path: os.PathLike[str], suffix: str, text: str) -> None:
    assert get_allocator_type(_extra_config_file(tmp_path, "extra" + suffix, text)) == "shm"


def test_a_non_string_allocator_in_the_extra_config_is_sglangs_dynamic() -> None:
    args = {"hicache_storage_backend": "dynamic",
            "hicache_storage_backend_extra_config": '{"allocator": 3}'}  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        assert get_allocator_type(args) == "dynamic"
    assert [e for e in logs if e["event"] == BAD_EXTRA_CONFIG] == []


@pytest.mark.parametrize("backend", [3, ["shm"], b"shm"])
def test_a_backend_that_is_not_a_string_is_a_config_error(backend: object) -> None:
    with pytest.raises(ConfigError, match="hicache_storage_backend must be a string"):
        get_allocator_type({"hicache_storage_backend": backend})


def _one_warning(logs: list[dict[str, object]]) -> dict[str, object]:
    (event,) = [e for e in logs if e["event"] == BAD_EXTRA_CONFIG]
    assert event["log_level"] == "warning" and event["answer"] == "dynamic"
    return event


@pytest.mark.parametrize(
    "extra",
    [
        "{not json",
        "[1, 2]",
        '"shm"',
        "null",
        "@/nonexistent/extra.json",
        42,
    ],
)
def test_malformed_extra_config_answers_as_sglang_with_a_warning(extra: object) -> None:
    """Issue 26 point 7: one rule with sglang's (and the integration's): the config is
    ignored, the answer is "dynamic", and a warning event says why; never an exception."""
    args = {"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config": extra}
    with structlog.testing.capture_logs() as logs:
        assert get_allocator_type(args) == "dynamic"
        assert get_allocator_type(SimpleNamespace(**args)) == "dynamic"
    bad = [e for e in logs if e["event"] == BAD_EXTRA_CONFIG]
    assert len(bad) == 2 and all(e["answer"] == "dynamic" for e in bad)
    if extra == "@/nonexistent/extra.json":
        assert all("/nonexistent/extra.json" in str(e["error"]) for e in bad)


@pytest.mark.parametrize(
    "suffix,text",
    [(".json", "{"), (".toml", "allocator = "), (".yaml", "a: [1"), (".ini", "[x]")],
)
def test_malformed_extra_config_files(tmp_path: os.PathLike[str], suffix: str, text: str) -> None:
    args = _extra_config_file(tmp_path, "bad" + suffix, text)
    with structlog.testing.capture_logs() as logs:
        assert get_allocator_type(args) == "dynamic"
    assert "bad" + suffix in str(_one_warning(logs)["error"])


def test_the_rule_lives_in_the_integration_and_the_core_does_not_import_it() -> None:
    """`hostpool.get_allocator_type` is the sglang integration's (the rule is written
    once); importing the core allocators does not import the integration."""
    from hostpool.integrations import sglang

    assert hostpool.get_allocator_type is sglang.get_allocator_type
    code = (
        "import sys, hostpool.core.allocators, hostpool.core.manager; "
        "print('hostpool.integrations.sglang' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_alloc_shm_mm_close_is_an_explicit_release(no_leaked_fds: None) -> None:
    from hostpool import alloc_shm

    ledger = get_ledger()
    before = ledger.counters().releases_total.get(("mmclose", "explicit"), 0)
    tensor, fd, mm = alloc_shm((1024,), torch.uint8, pool="mmclose")
    address = tensor.data_ptr()
    del tensor
    mm.close()  # no view left: unmapped now, and hostpool's own fd with it
    assert not helpers.range_mapped(address, 4096)
    assert ledger.snapshot(["mmclose"]) == []
    assert ledger.counters().releases_total[("mmclose", "explicit")] == before + 1
    assert list(helpers.fd_links("hostpool.mmclose.")) == [fd]  # only the caller's dup
    os.close(fd)
    del mm


def test_retaining_shm_allocator_keeps_fds_for_its_life(no_leaked_fds: None) -> None:
    """sglang's semantics (issue 15): its allocator's fds stay valid while it lives,
    `fd` is the first; close() releases them explicitly."""
    alloc = ShmHostTensorAllocator("retained", retain=True)
    first = alloc.allocate((64, 1024), torch.float16)
    alloc.allocate((64, 1024), torch.float16)  # dropped at once
    fds = alloc.fds
    assert len(fds) == 2 and alloc.fd == fds[0]
    del first
    gc.collect()
    assert alloc.fds == fds
    for fd in fds:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:hostpool.retained.")
    alloc.close()
    assert alloc.fds == [] and alloc.regions == []
    gc.collect()
    ledger = get_ledger()
    ledger.drain()
    releases = {
        how: n for (pool, how), n in ledger.counters().releases_total.items() if pool == "retained"
    }
    assert releases == {"explicit": 2}  # a healthy close is never the leak signal
    assert helpers.maps_lines("hostpool.retained.") == []


def test_retaining_allocator_releases_a_region_through_any_view(no_leaked_fds: None) -> None:
    alloc = ShmHostTensorAllocator("retained_view", retain=True)
    alloc.allocate((64, 1024), torch.float16)
    view = alloc.allocate((64, 1024), torch.float16)[10:]  # not at the region's start
    (region,) = [
        r
        for r in alloc.regions
        if r.facts.address <= view.data_ptr() < r.facts.address + r.facts.mapped_bytes
    ]
    address, length = region.facts.address, region.facts.mapped_bytes
    del region
    assert alloc.release(view) is False  # the view still maps it
    del view
    gc.collect()
    assert len(alloc.fds) == 1
    assert not helpers.range_mapped(address, length)
    alloc.close()


# -- how a region ends (issue 26 point 1) ----------------------------------------------
def _releases(pool: str) -> dict[str, int]:
    ledger = get_ledger()
    ledger.drain()
    return {how: n for (p, how), n in ledger.counters().releases_total.items() if p == pool and n}


def test_alloc_shm_used_by_contract_is_never_the_leak_signal(no_leaked_fds: None) -> None:
    """The caller closes its dup, `mm.close()`s while the tensor lives, drops the tensor:
    an explicit release (the pages go with the last view), never `finalizer`."""
    from hostpool import alloc_shm

    tensor, fd, mm = alloc_shm((64, 1024), torch.float32, pool="contract_shm")
    (record,) = get_ledger().snapshot(["contract_shm"])
    os.close(fd)
    mm.close()  # views live: released now, unmapped with the last view
    (after,) = get_ledger().snapshot(["contract_shm"])
    assert after.state == "released_mapped"
    assert _releases("contract_shm") == {"explicit": 1}
    # hostpool's own fd went with the release; mmap's internal dup lives with the mapping
    assert len(helpers.fd_links("hostpool.contract_shm.")) == 1
    tensor.fill_(1.0)  # nothing was unmapped under it
    del tensor, mm
    gc.collect()
    assert not helpers.range_mapped(record.address, record.mapped_bytes)
    assert get_ledger().snapshot(["contract_shm"]) == []
    assert _releases("contract_shm") == {"explicit": 1}
    assert helpers.fd_links("hostpool.contract_shm.") == {}


def test_alloc_shm_and_alloc_mmap_end_with_their_tensor(no_leaked_fds: None) -> None:
    """Handed to the tensor by contract: collected with it is `tensor`, the normal end."""
    from hostpool import alloc_mmap, alloc_shm

    tensor, fd, mm = alloc_shm((4096,), torch.uint8, pool="with_tensor")
    os.close(fd)
    del tensor, mm
    t = alloc_mmap((4096,), torch.uint8, pool="with_tensor")
    del t
    gc.collect()
    assert _releases("with_tensor") == {"tensor": 2}
    assert get_ledger().snapshot(["with_tensor"]) == []


def test_a_plain_allocators_dropped_tensor_ends_with_the_tensor(no_leaked_fds: None) -> None:
    """A non-retaining allocator's tensors own their memory (its documented contract)."""
    alloc = ShmHostTensorAllocator("plain_drop")
    t = alloc.allocate((4096,), torch.uint8)
    del t
    gc.collect()
    assert _releases("plain_drop") == {"tensor": 1}
    alloc.close()


def test_a_retaining_allocator_collected_without_close_is_the_leak_signal(
    no_leaked_fds: None,
) -> None:
    """An owner that should have released its regions was collected first: `finalizer`."""
    for cls in (ShmHostTensorAllocator, MmapHostTensorAllocator, DefaultHostTensorAllocator):
        pool = f"retained_leak_{cls.kind}"
        alloc = cls(pool, retain=True)
        alloc.allocate((4096,), torch.uint8)
        alloc.allocate((4096,), torch.uint8)
        del alloc
        gc.collect()
        assert _releases(pool) == {"finalizer": 2}, cls
        assert get_ledger().snapshot([pool]) == []
