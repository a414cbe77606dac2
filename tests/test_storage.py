"""Storage backends: the shm dummy, the file backend on a real directory, and the
registry (lazy import, subclass check, dynamic backends, allocator resolution)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hostpool.allocators import allocator_names
from hostpool.errors import ConfigError
from hostpool.storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    backend_class,
    backend_names,
    create_backend,
    register_backend,
    resolve_allocator,
    unregister_backend,
)
from hostpool.storage.file import HiCacheFile
from hostpool.storage.shm import HiCacheShm

FIXTURE = "tests.dynamic_backend_fixture"


@pytest.fixture
def store(tmp_path: Path) -> HiCacheFile:
    return HiCacheFile(
        HiCacheStorageConfig(model_name="meta-llama/Llama-3.1-8B"), file_path=str(tmp_path)
    )


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names registered by a test, unregistered after it."""
    names: list[str] = []
    yield names
    for name in names:
        unregister_backend(name)


# -- shm ---------------------------------------------------------------------------------
def test_shm_backend_misses_every_get_and_accepts_every_set() -> None:
    shm = create_backend("shm")
    assert isinstance(shm, HiCacheShm)
    page = torch.ones(4)
    assert shm.set("k", page) and shm.batch_set(["a", "b"], [page, page])
    assert shm.get("k") is None and shm.batch_get(["a", "b"]) == [None, None]
    assert not shm.exists("k") and shm.batch_exists(["a", "b"]) == 0
    assert shm.clear()


# -- file --------------------------------------------------------------------------------
def test_file_round_trip_into_a_target(store: HiCacheFile) -> None:
    page = torch.arange(2 * 3 * 8, dtype=torch.float32).to(torch.bfloat16).reshape(2, 3, 8)
    assert store.set("prefix-hash-1", page)
    target = torch.zeros_like(page)
    assert store.get("prefix-hash-1", target) is target
    assert torch.equal(target, page)
    raw = store.get("prefix-hash-1")
    assert raw is not None and raw.dtype == torch.uint8 and raw.numel() == page.numel() * 2


def test_file_reads_into_a_strided_target(store: HiCacheFile) -> None:
    page = torch.arange(16, dtype=torch.int32).reshape(4, 4)
    store.set("k", page)
    host = torch.zeros(4, 8, dtype=torch.int32)
    view = host[:, ::2]  # not contiguous: read through staging, then copied in
    assert store.get("k", view) is view
    assert torch.equal(host[:, ::2], page) and host[:, 1::2].abs().sum() == 0


def test_file_size_mismatch_is_a_miss(store: HiCacheFile) -> None:
    store.set("k", torch.ones(8))
    assert store.get("k", torch.zeros(4)) is None
    assert store.get("missing", torch.zeros(8)) is None


def test_keys_become_safe_names_inside_the_directory(store: HiCacheFile, tmp_path: Path) -> None:
    for key in ("../../etc/passwd", "/abs/key", "a/b", "x" * 5000, "ключ"):
        assert store.set(key, torch.ones(2))
        path = Path(store.path_of(key))
        assert path.parent == tmp_path and len(path.name) == 64 + 4
        assert store.exists(key)
    assert len(list(tmp_path.iterdir())) == 5


def test_existing_keys_are_not_rewritten(store: HiCacheFile) -> None:
    store.set("k", torch.ones(4))
    assert store.set("k", torch.zeros(4))  # keys name content: already stored
    assert torch.equal(store.get("k", torch.empty(4)), torch.ones(4))  # type: ignore[arg-type]


def test_batch_exists_counts_the_leading_hits(store: HiCacheFile) -> None:
    store.batch_set(["a", "b", "d"], [torch.ones(1)] * 3)
    assert store.batch_exists(["a", "b", "c", "d"]) == 2
    assert store.batch_get(["a", "c"], [torch.zeros(1), torch.zeros(1)])[1] is None


def test_ranks_and_mla_models_share_or_split_pages(tmp_path: Path) -> None:
    def backend(rank: int, mla: bool) -> HiCacheFile:
        config = HiCacheStorageConfig(tp_rank=rank, tp_size=2, is_mla_model=mla, model_name="m")
        return HiCacheFile(config, file_path=str(tmp_path))

    backend(0, mla=False).set("k", torch.ones(1))
    assert not backend(1, mla=False).exists("k")  # MHA ranks hold different heads
    backend(0, mla=True).set("k", torch.ones(1))
    assert backend(1, mla=True).exists("k")  # an MLA latent is the same on every rank


def test_writes_are_atomic(store: HiCacheFile, monkeypatch: pytest.MonkeyPatch) -> None:
    final = Path(store.path_of("k"))
    seen: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        seen.append(final.exists())  # the data is complete only now, the name not yet there
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert store.set("k", torch.ones(1024))
    assert seen == [False] and final.stat().st_size == 4096

    def crash(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    assert not store.set("k2", torch.ones(8))
    assert not store.exists("k2")
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temporary left


def test_clear_removes_pages_and_strays_but_nothing_else(
    store: HiCacheFile, tmp_path: Path
) -> None:
    store.set("k", torch.ones(2))
    stray = tmp_path / f".{'a' * 64}.{'0' * 12}.tmp"
    stray.write_bytes(b"half")
    other = tmp_path / "README"
    other.write_text("not ours")
    assert store.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README"]


def test_file_path_from_extra_config_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    via_extra = HiCacheFile(HiCacheStorageConfig(extra_config={"file_path": str(tmp_path / "x")}))
    assert via_extra.file_path == str(tmp_path / "x") and (tmp_path / "x").is_dir()
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "env"))
    assert create_backend("file").file_path == str(tmp_path / "env")  # type: ignore[attr-defined]


# -- registry ----------------------------------------------------------------------------
def test_builtins_and_their_allocators() -> None:
    assert {"file", "shm", "dynamic"} <= set(backend_names())
    assert resolve_allocator("shm") == "shm"
    assert resolve_allocator("file") == "default"
    assert resolve_allocator("mmap") == "mmap"  # an allocator name stands for itself


def test_registration_is_lazy(registered: list[str]) -> None:
    sys.modules.pop(FIXTURE, None)
    register_backend("dict", FIXTURE, "DictStorage", allocator="shm")
    registered.append("dict")
    assert FIXTURE not in sys.modules  # nothing imported yet
    assert resolve_allocator("dict") == "shm"  # resolving needs no import either
    assert FIXTURE not in sys.modules
    cls = backend_class("dict")
    assert FIXTURE in sys.modules and issubclass(cls, HiCacheStorage)
    assert backend_class("dict") is cls  # cached


def test_broken_registrations_fail_at_first_use(registered: list[str]) -> None:
    register_backend("missing", "no.such.module", "Backend")
    register_backend("notsub", FIXTURE, "NotAStorage")
    register_backend("noclass", FIXTURE, "Nope")
    registered += ["missing", "notsub", "noclass"]
    with pytest.raises(ConfigError, match=r"cannot import 'no\.such\.module'"):
        create_backend("missing")
    with pytest.raises(ConfigError, match="must inherit from HiCacheStorage"):
        backend_class("notsub")
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        backend_class("noclass")


def test_unknown_names_list_what_is_known(registered: list[str]) -> None:
    # Other tests may register allocators of their own: list what is known now.
    with pytest.raises(ConfigError, match=re.escape(f"registered: {backend_names()}")):
        create_backend("nixl")
    with pytest.raises(ConfigError, match=re.escape(f"allocator {allocator_names()}")):
        resolve_allocator("nixl")
    register_backend("gds", FIXTURE, "DictStorage", allocator="cufile")
    registered.append("gds")
    with pytest.raises(ConfigError, match="needs allocator 'cufile'"):
        resolve_allocator("gds")
    with pytest.raises(ConfigError, match="reserved"):
        register_backend("dynamic", FIXTURE, "DictStorage")


def test_dynamic_backend_from_extra_config() -> None:
    extra = {
        "backend_name": "mine",
        "module_path": FIXTURE,
        "class_name": "DictStorage",
        "allocator": "shm",
    }
    backend = create_backend("dynamic", HiCacheStorageConfig(extra_config=extra), None, tier="l3")
    assert type(backend).__name__ == "DictStorage"
    assert backend.kwargs == {"tier": "l3"}  # type: ignore[attr-defined]
    assert backend.set("k", torch.ones(2)) and backend.exists("k")
    assert resolve_allocator("dynamic", extra_config=extra) == "shm"
    assert resolve_allocator("dynamic", extra_config={"allocator": "mmap"}) == "mmap"
    assert resolve_allocator("dynamic", extra_config=None) == "default"


def test_dynamic_backend_errors() -> None:
    with pytest.raises(ConfigError, match=r"lacks \['module_path', 'class_name'\]"):
        create_backend("dynamic", HiCacheStorageConfig(extra_config={"backend_name": "x"}))
    bad = {"backend_name": "x", "module_path": FIXTURE, "class_name": "NotAStorage"}
    with pytest.raises(ConfigError, match="must inherit from HiCacheStorage"):
        create_backend("dynamic", HiCacheStorageConfig(extra_config=bad))
    with pytest.raises(ConfigError, match="non-empty string"):
        resolve_allocator("dynamic", extra_config={"allocator": 3})
