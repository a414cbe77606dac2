"""Host pool layouts, sglang's sizing rule, and the slot free-list."""

from __future__ import annotations

import random

import pytest
import torch

from hostpool.errors import ConfigError, InvalidRequestError
from hostpool.pools.freelist import SlotFreeList
from hostpool.pools.layouts import (
    IndexerLayout,
    MambaLayout,
    MHALayout,
    MLALayout,
    Sizing,
    size_pool,
)

# Llama-3.1-8B per rank at TP 1: 32 layers, 8 KV heads of 128, bf16.
LLAMA = MHALayout(layer_num=32, head_num=8, head_dim=128, dtype=torch.bfloat16)
# DeepSeek-V3: 61 layers, latent 512 + rope 64, bf16.
DSV3 = MLALayout(layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)


def test_bytes_per_token_are_sglangs() -> None:
    assert LLAMA.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert DSV3.kv_dim == 576
    assert DSV3.bytes_per_token == 61 * 576 * 2
    # fp8 keys (128 bytes) plus one fp32 scale per 128 values, per layer.
    assert IndexerLayout(61, 128).bytes_per_token == 61 * (128 + 4)


def test_size_from_hicache_size_adds_one_page() -> None:
    # int(4e6 // 131072) = 30 tokens; 30 // 16 + 1 = 2 pages.
    s = size_pool(LLAMA.bytes_per_token, page_size=16, hicache_size_gb=0.004)
    assert s == Sizing(size=32, page_num=2, page_size=16)


def test_size_from_ratio_adds_a_page_even_on_a_boundary() -> None:
    s = size_pool(LLAMA.bytes_per_token, page_size=64, device_size=1024, ratio=2.0)
    assert (s.page_num, s.size) == (2048 // 64 + 1, 33 * 64)
    s = size_pool(LLAMA.bytes_per_token, page_size=64, device_size=1000, ratio=1.5)
    assert (s.page_num, s.size) == (1500 // 64 + 1, 24 * 64)


def test_hicache_size_wins_over_ratio() -> None:
    s = size_pool(1000, page_size=1, hicache_size_gb=0.001, device_size=10**6, ratio=2.0)
    assert s.size == 1_000_000 // 1000 + 1


def test_no_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="hicache_size"):
        size_pool(1000, page_size=1)
    with pytest.raises(ConfigError, match="page_size"):
        size_pool(1000, page_size=0, device_size=10)


def test_mha_dims_per_layout() -> None:
    s = Sizing(size=4 * 16, page_num=4, page_size=16)
    layouts = ("layer_first", "page_first", "page_first_direct", "page_head")
    dims = {layout: LLAMA.buffers(layout, s)[0].dims for layout in layouts}
    assert dims == {
        "layer_first": (2, 32, 64, 8, 128),
        "page_first": (2, 64, 32, 8, 128),
        "page_first_direct": (2, 4, 32, 16, 8, 128),
        "page_head": (2, 4, 8, 16, 32, 128),
    }
    for layout in layouts:  # the same bytes, arranged differently
        assert LLAMA.buffers(layout, s)[0].nbytes == 64 * LLAMA.bytes_per_token


def test_mla_dims_per_layout_and_no_page_head() -> None:
    s = Sizing(size=3 * 64, page_num=3, page_size=64)
    assert DSV3.buffers("layer_first", s)[0].dims == (61, 192, 1, 576)
    assert DSV3.buffers("page_first", s)[0].dims == (192, 61, 1, 576)
    assert DSV3.buffers("page_first_direct", s)[0].dims == (3, 61, 64, 1, 576)
    with pytest.raises(ConfigError, match="MLA pools support layouts"):
        DSV3.buffers("page_head", s)


def test_indexer_pages_run_one_ahead_of_kv() -> None:
    s = Sizing(size=3 * 64, page_num=3, page_size=64)
    (buf,) = IndexerLayout(61, 128).buffers("layer_first", s)
    assert buf.dims == (61, (192 + 64 + 1) // 64, 64 * 132)
    assert buf.dtype == torch.uint8


def test_mamba_state_buffers() -> None:
    m = MambaLayout(
        layer_num=27,
        conv_shapes=((12288, 3),),
        temporal_shape=(128, 80, 128),
        conv_dtype=torch.bfloat16,
        temporal_dtype=torch.float32,
    )
    assert m.bytes_per_token == 27 * (12288 * 3 * 2 + 128 * 80 * 128 * 4)
    s = Sizing(size=5, page_num=5, page_size=1)
    lf = {b.name: b.dims for b in m.buffers("layer_first", s)}
    pf = {b.name: b.dims for b in m.buffers("page_first", s)}
    assert lf == {"temporal": (27, 5, 128, 80, 128), "conv0": (27, 5, 12288, 3)}
    assert pf == {"temporal": (5, 27, 1, 128, 80, 128), "conv0": (5, 27, 1, 12288, 3)}
    with pytest.raises(ConfigError):
        m.buffers("page_head", s)


def test_bad_dims_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="head_num"):
        MHALayout(layer_num=2, head_num=0, head_dim=8, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="positive int"):
        MLALayout(layer_num=2, kv_lora_rank=True, qk_rope_head_dim=8, dtype=torch.bfloat16)


# -- free-list -------------------------------------------------------------------------
def test_alloc_hands_out_whole_pages_until_empty() -> None:
    fl = SlotFreeList(size=8, page_size=4)
    first = fl.alloc(4)
    assert first is not None and first.tolist() == [0, 1, 2, 3]
    second = fl.alloc(4)
    assert second is not None and second.tolist() == [4, 5, 6, 7]
    assert fl.alloc(4) is None  # exhausted: None, as sglang's pools answer
    assert fl.available_size() == 0


def test_alloc_size_must_be_whole_pages() -> None:
    fl = SlotFreeList(size=8, page_size=4)
    with pytest.raises(InvalidRequestError, match="multiple of the page size"):
        fl.alloc(3)
    with pytest.raises(InvalidRequestError):
        fl.alloc(0)


def test_double_free_is_refused_and_changes_nothing() -> None:
    fl = SlotFreeList(size=8, page_size=2)
    slots = fl.alloc(4)
    assert slots is not None
    assert fl.free(slots) == 4
    with pytest.raises(InvalidRequestError, match="double free"):
        fl.free(slots)
    assert fl.available_size() == 8
    again = fl.alloc(8)
    assert again is not None and sorted(again.tolist()) == list(range(8))  # no duplicate


def test_foreign_and_repeated_slots_are_refused() -> None:
    fl = SlotFreeList(size=8)
    fl.alloc(4)
    with pytest.raises(InvalidRequestError, match="foreign"):
        fl.free([3, 8])
    with pytest.raises(InvalidRequestError, match="foreign"):
        fl.free(torch.tensor([-1]))
    with pytest.raises(InvalidRequestError, match="repeat"):
        fl.free([1, 1])
    with pytest.raises(InvalidRequestError, match="integers"):
        fl.free(torch.tensor([1.0]))
    # None of the refused calls freed anything.
    assert fl.available_size() == 4


def test_double_alloc_of_claimed_slots_is_refused() -> None:
    fl = SlotFreeList(size=8, page_size=2)
    assert fl.alloc_slots([2, 3]).tolist() == [2, 3]
    with pytest.raises(InvalidRequestError, match="double alloc"):
        fl.alloc_slots([2, 3])
    with pytest.raises(InvalidRequestError, match="whole pages"):
        fl.alloc_slots([4])
    out = fl.alloc(6)
    assert out is not None and 2 not in out.tolist() and 3 not in out.tolist()


def test_a_page_comes_back_only_when_all_its_slots_do() -> None:
    fl = SlotFreeList(size=4, page_size=2)
    slots = fl.alloc(4)
    assert slots is not None
    fl.free([0])
    assert fl.available_size() == 0  # page 0 still half in use
    fl.free([1])
    assert fl.available_size() == 2
    assert fl.alloc(2) is not None


def test_random_use_matches_a_model() -> None:
    rng = random.Random(7)
    fl = SlotFreeList(size=64, page_size=4)
    out: set[int] = set()
    for _ in range(500):
        if out and rng.random() < 0.5:
            chosen = rng.sample(sorted(out), rng.randint(1, min(8, len(out))))
            fl.free(chosen)
            out -= set(chosen)
        else:
            got = fl.alloc(4 * rng.randint(1, 3))
            if got is None:
                continue
            slots = set(got.tolist())
            assert not slots & out, "a slot was handed out twice"
            out |= slots
        free_pages = {p for p in range(16) if not any(s // 4 == p for s in out)}
        assert fl.available_size() == 4 * len(free_pages)
