"""Real sglang host pools on CPU over a minimal stand-in device pool (test support)."""

from __future__ import annotations

from typing import Any

import torch

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 16, 16
DEVICE_TOKENS = 128  # x ratio 2 -> 256 tokens + one padding page: 4 KiB multiples


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha(layout: str, allocator_type: str, label: str) -> Any:
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v), layout=KVBufferLayout.NHD
        ),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator_type,
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
        pool_label=label,
    )


def buffers(pool: Any) -> list[torch.Tensor]:
    kv = pool.kv_buffer
    if isinstance(kv, list | tuple):
        return [b for b in kv if b is not None]
    return [kv]
