"""The hybrid assembler on real models' config.json: plans at full size (no memory),
builds at small sizes (real memory, one manager), and the errors a bad config gets.

Fixtures (tests/fixtures/models) carry the published fields of: Llama-3.1-8B-Instruct
(MHA, GQA 8 KV heads), DeepSeek-V3 (MLA), DeepSeek-V3.2 (MLA with the sparse-attention
indexer), gpt-oss-20b (alternating sliding/full attention) and NVIDIA-Nemotron-Nano-9B-v2
(Mamba-2/attention hybrid, `hybrid_override_pattern`).
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hostpool import AllocationError, ConfigError, HostPoolManager
from hostpool.allocators import allocator_names
from hostpool.lifecycle import get_ledger
from hostpool.pools import assemble_host_pools, plan_host_pools
from hostpool.pools.modelconfig import layer_kinds
from tests import helpers

MODELS = Path(__file__).parent / "fixtures" / "models"
LLAMA = MODELS / "llama-3.1-8b-instruct.json"
DSV3 = MODELS / "deepseek-v3.json"
DSV32 = MODELS / "deepseek-v3.2.json"
GPT_OSS = MODELS / "gpt-oss-20b.json"
NEMOTRON = MODELS / "nemotron-nano-9b-v2.json"
SMALL = 0.004  # GB: a few MiB per pool


def cfg(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# -- plans (no memory) -----------------------------------------------------------------
def test_llama_is_one_mha_pool() -> None:
    plan = plan_host_pools(LLAMA, {"device_pool_size": 100_000, "page_size": 64})
    (kv,) = plan.pools
    assert (kv.name, kv.kind, kv.layers) == ("kv", "mha", tuple(range(32)))
    assert kv.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert kv.sizing.page_num == 200_000 // 64 + 1
    assert kv.buffers[0].dims == (2, 32, kv.sizing.size, 8, 128)
    assert kv.buffers[0].dtype == torch.bfloat16
    assert plan.allocator == "default"


def test_layout_and_tp_follow_server_args() -> None:
    args = {"device_pool_size": 1000, "page_size": 16, "hicache_mem_layout": "page_first_direct"}
    kv = plan_host_pools(LLAMA, {**args, "tp_size": 4}).pool("kv")
    assert kv.buffers[0].dims == (2, kv.sizing.page_num, 32, 16, 2, 128)
    # More ranks than KV heads: each rank keeps one head.
    assert plan_host_pools(LLAMA, {**args, "tp_size": 16}).pool("kv").buffers[0].dims[4] == 1


def test_deepseek_v3_is_one_mla_pool() -> None:
    plan = plan_host_pools(DSV3, {"hicache_size": 100, "page_size": 64})
    (kv,) = plan.pools
    assert kv.kind == "mla"
    assert kv.bytes_per_token == 61 * (512 + 64) * 2
    assert kv.sizing.page_num == int(100e9 // kv.bytes_per_token) // 64 + 1
    assert kv.buffers[0].dims == (61, kv.sizing.size, 1, 576)


def test_deepseek_v32_adds_the_indexer_paged_with_kv() -> None:
    plan = plan_host_pools(DSV32, {"hicache_size": 100, "page_size": 64})
    kv, indexer = plan.pools
    assert (kv.name, indexer.name) == ("kv", "indexer")
    # As sglang's NSA host pool: the indexer's bytes count in kv's per-token size.
    assert kv.bytes_per_token == 61 * 576 * 2 + 61 * (128 + 4)
    assert indexer.sizing == kv.sizing
    page_num = (kv.sizing.size + 64 + 1) // 64
    assert indexer.buffers[0].dims == (61, page_num, 64 * 132)


def test_gpt_oss_splits_full_and_sliding_layers() -> None:
    plan = plan_host_pools(GPT_OSS, {"device_pool_size": 10_000, "page_size": 32})
    kv, swa = plan.pools
    assert kv.layers == tuple(range(1, 24, 2))
    assert swa.layers == tuple(range(0, 24, 2))
    assert kv.buffers[0].dims[1:] == (12, kv.sizing.size, 8, 64)
    # sglang's SWA device pool is swa_full_tokens_ratio (0.8) of the full one.
    assert kv.sizing.page_num == 20_000 // 32 + 1
    assert swa.sizing.page_num == int(8000 * 2.0) // 32 + 1


def test_nemotron_h_has_kv_and_mamba_state() -> None:
    plan = plan_host_pools(NEMOTRON, {"device_pool_size": 1000, "max_mamba_cache_size": 10})
    kv, mamba = plan.pools
    pattern = cfg(NEMOTRON)["hybrid_override_pattern"]
    assert kv.layers == tuple(i for i, c in enumerate(pattern) if c == "*")
    assert mamba.layers == tuple(i for i, c in enumerate(pattern) if c == "M")
    assert len(kv.layers) == 4 and len(mamba.layers) == 27
    conv_dim = 128 * 80 + 2 * 8 * 128
    dims = {b.name: (b.dims, b.dtype) for b in mamba.buffers}
    assert dims == {
        "temporal": ((27, 21, 128, 80, 128), torch.float32),  # 10 * 2 + 1 states
        "conv0": ((27, 21, conv_dim, 3), torch.bfloat16),
    }
    assert mamba.bytes_per_token == 27 * (conv_dim * 3 * 2 + 128 * 80 * 128 * 4)


def test_mamba_state_splits_over_tp() -> None:
    args = {"device_pool_size": 100, "max_mamba_cache_size": 4, "tp_size": 8}
    mamba = plan_host_pools(NEMOTRON, {**args, "mamba_ssm_dtype": "bfloat16"}).pool("mamba")
    dims = {b.name: b.dims[2:] for b in mamba.buffers}
    assert dims == {"temporal": (16, 80, 128), "conv0": ((128 * 80 + 2 * 8 * 128) // 8, 3)}
    assert mamba.buffers[0].dtype == torch.bfloat16


def test_fp8_kv_cache_is_stored_as_bytes_and_leaves_mamba_state_alone() -> None:
    args = {"device_pool_size": 100, "max_mamba_cache_size": 2, "kv_cache_dtype": "fp8_e4m3"}
    plan = plan_host_pools(NEMOTRON, args)
    assert plan.pool("kv").buffers[0].dtype == torch.uint8  # sglang's fp8 store dtype
    assert plan.pool("kv").bytes_per_token == 2 * 4 * 8 * 128
    dtypes = {b.name: b.dtype for b in plan.pool("mamba").buffers}
    assert dtypes == {"temporal": torch.float32, "conv0": torch.bfloat16}
    with pytest.raises(ConfigError, match="unsupported KV cache dtype 'int3'"):
        plan_host_pools(LLAMA, {"hicache_size": 1, "kv_cache_dtype": "int3"})


def test_other_hybrid_spellings() -> None:
    base = {"num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4}
    jamba = {**base, "attn_layer_period": 4, "attn_layer_offset": 2}
    assert layer_kinds(jamba) == ("mamba", "mamba", "full", "mamba") * 2
    qwen3_next = {**base, "full_attention_interval": 4}
    assert layer_kinds(qwen3_next) == ("mamba", "mamba", "mamba", "full") * 2
    granite = {**base, "layer_types": ["mamba", "attention"] * 4}
    assert layer_kinds(granite) == ("mamba", "full") * 4


@pytest.mark.parametrize(
    ("args", "allocator"),
    [
        ({}, "default"),
        ({"hicache_storage_backend": "file"}, "default"),
        ({"hicache_storage_backend": "shm"}, "shm"),
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
                "hicache_storage_backend_extra_config": {"allocator": "mmap"},
            },
            "mmap",
        ),
    ],
)
def test_allocator_comes_from_the_storage_backend(args: dict[str, Any], allocator: str) -> None:
    plan = plan_host_pools(LLAMA, {"device_pool_size": 100, **args})
    assert plan.allocator == allocator


def test_unknown_backend_and_bad_extra_config_are_config_errors() -> None:
    known = re.escape(str(allocator_names()))  # other tests may register more
    with pytest.raises(ConfigError, match=rf"'mooncake'.*{known}"):
        plan_host_pools(LLAMA, {"device_pool_size": 100, "hicache_storage_backend": "mooncake"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        plan_host_pools(
            LLAMA,
            {
                "device_pool_size": 100,
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": "{allocator: shm",
            },
        )


def test_bad_configs_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="hicache_size"):
        plan_host_pools(LLAMA, {})  # neither hicache_size nor a device pool size
    with pytest.raises(ConfigError, match="unknown layer type 'cross_attention'"):
        plan_host_pools(
            {**cfg(GPT_OSS), "layer_types": ["cross_attention"] * 24}, {"hicache_size": 1}
        )
    with pytest.raises(ConfigError, match="23 entries for 24"):
        plan_host_pools(
            {**cfg(GPT_OSS), "layer_types": ["full_attention"] * 23}, {"hicache_size": 1}
        )
    with pytest.raises(ConfigError, match="hicache_mem_layout"):
        plan_host_pools(LLAMA, {"hicache_size": 1, "hicache_mem_layout": "page_last"})
    with pytest.raises(ConfigError, match="MLA pools support layouts"):
        plan_host_pools(DSV3, {"hicache_size": 1, "hicache_mem_layout": "page_head"})
    no_state = {k: v for k, v in cfg(NEMOTRON).items() if not k.startswith(("mamba", "ssm"))}
    with pytest.raises(ConfigError, match="no state fields"):
        plan_host_pools(no_state, {"hicache_size": 1})


# -- builds (real memory) --------------------------------------------------------------
def _live_regions(pools: set[str]) -> list[Any]:
    gc.collect()
    return [r for r in get_ledger().snapshot() if r.pool in pools]


def test_build_hybrid_through_one_manager() -> None:
    args = {"hicache_size": SMALL, "page_size": 16, "hicache_storage_backend": "shm"}
    with HostPoolManager() as manager:
        pools = assemble_host_pools(GPT_OSS, args, manager)
        assert set(manager.pools) == {"kv", "swa"}
        records = manager.snapshot()
        assert sorted(r.pool for r in records) == ["kv", "swa"]
        for record in records:
            pool = pools[record.pool]
            assert record.allocator == "shm" and record.name is not None
            assert record.name.startswith(f"hostpool.{record.pool}.")
            assert tuple(record.dims) == pool.plan.buffers[0].dims
            assert pool.buffer.shape == pool.plan.buffers[0].dims
            assert record.mapped_bytes >= pool.plan.nbytes
        # /proc/self/fd shows one distinct memfd per pool, named for it
        links = helpers.fd_links()
        for pool_name in ("kv", "swa"):
            named = {t for t in links.values() if f"/memfd:hostpool.{pool_name}." in t}
            assert len(named) == 1, (pool_name, links)
        assert len(set(links.values())) >= 2
        k, v = pools["kv"].k_buffer, pools["kv"].v_buffer
        k.fill_(1)
        v.fill_(2)
        assert pools["kv"].buffer.sum().item() == 3 * k.numel()
        assert pools["kv"].free_slots is not None
        assert pools["kv"].free_slots.size == pools["kv"].plan.sizing.size
        report = pools.close()
        del k, v
        assert not report
    assert _live_regions({"kv", "swa"}) == []
    assert helpers.fd_links("hostpool.kv.") == {} and helpers.fd_links("hostpool.swa.") == {}


def test_build_mla_with_indexer_and_mamba_hybrid() -> None:
    with HostPoolManager() as manager:
        dsv32 = assemble_host_pools(DSV32, {"hicache_size": SMALL, "page_size": 64}, manager)
        assert dsv32["indexer"].buffer.dtype == torch.uint8
        assert dsv32["indexer"].free_slots is None  # indexed by kv's pages
        assert dsv32["kv"].buffer.shape[-1] == 576
        dsv32.close()
        args = {
            "hicache_size": SMALL,
            "tp_size": 8,
            "mamba_ssm_dtype": "bfloat16",
            "hicache_mem_layout": "page_first",
        }
        hybrid = assemble_host_pools(NEMOTRON, args, manager)
        mamba = hybrid["mamba"]
        assert set(mamba.buffers) == {"temporal", "conv0"}
        assert mamba.buffers["temporal"].shape == (1, 27, 1, 16, 80, 128)  # one state
        assert mamba.free_slots is not None and mamba.free_slots.page_size == 1
        assert {r.pool for r in manager.snapshot()} == {"kv", "mamba"}
        hybrid.close()
        assert manager.snapshot() == []


def test_own_manager_closes_with_the_pools() -> None:
    pools = assemble_host_pools(DSV3, {"hicache_size": SMALL})
    assert pools.owns_manager and pools.plan.allocator == "default"
    report = pools.close()
    assert not report and pools.manager.snapshot() == []


def test_a_leaked_view_is_reported() -> None:
    pools = assemble_host_pools(LLAMA, {"hicache_size": SMALL, "page_size": 16})
    kept = pools["kv"].k_buffer  # a view the caller still holds at close
    report = pools.close()
    assert report and report.leaks[0].pool == "kv"
    del kept


def test_failed_build_releases_what_it_made() -> None:
    plan = plan_host_pools(GPT_OSS, {"hicache_size": SMALL, "page_size": 16})
    kv_bytes = plan.pool("kv").nbytes
    # Room for kv but not for swa as well.
    with HostPoolManager(budget=kv_bytes + 4096) as manager:
        with pytest.raises(AllocationError, match="budget"):
            assemble_host_pools(GPT_OSS, {"hicache_size": SMALL, "page_size": 16}, manager)
        gc.collect()
        assert manager.snapshot() == []
