"""Real sglang host pools on CPU over a minimal stand-in device pool (test support)."""

from __future__ import annotations

from typing import Any

import torch

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 16, 16
DEVICE_TOKENS = 128  # x ratio 2 -> 256 tokens + one padding page: 4 KiB multiples


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


# the page size, dtype and device of the MHA and MLA device pools
ON_CPU: dict[str, Any] = {"page_size": PAGE, "dtype": torch.float32, "device": torch.device("cpu")}


def _host(cls: Any, info: Any, layout: str, allocator_type: str, label: str, **extra: Any) -> Any:
    """A token-to-KV host pool of `cls` over `info`: twice the device pool, unpinned, on CPU."""
    return cls(
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
        **extra,
    )


def mha(layout: str, allocator_type: str, label: str) -> Any:
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v), layout=KVBufferLayout.NHD
        ),
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        **ON_CPU,
    )
    return _host(MHATokenToKVPoolHost, info, layout, allocator_type, label)


def buffers(pool: Any) -> list[torch.Tensor]:
    """The host buffers sglang allocated for `pool`, in allocation order."""
    state = vars(pool)
    kv = pool.kv_buffer
    if "k_buffer" in state and kv is state["k_buffer"]:  # split MLA: one per component
        names = ("k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")
        return [state[n] for n in names if state.get(n) is not None]
    if isinstance(kv, list | tuple):
        return [b for b in kv if b is not None]
    return [kv]


MLA_LORA, MLA_ROPE = 32, 16


def mla(layout: str, allocator_type: str, label: str, *, split: bool = False) -> Any:
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo, MLASplitBuffers
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    width = MLA_LORA + MLA_ROPE
    buffers: Any
    if split:  # native split k/v components
        buffers = MLASplitBuffers(
            k=torch.zeros(LAYERS, DEVICE_TOKENS, 1, MLA_LORA),
            v=torch.zeros(LAYERS, DEVICE_TOKENS, 1, MLA_ROPE),
            index_k=None,
            index_scales=None,
            index_layer_indices=(),
            k_width=MLA_LORA,
            v_width=MLA_ROPE,
            index_width=0,
        )
        pointers = None
    else:
        buffers = tuple(torch.zeros(DEVICE_TOKENS, 1, width) for _ in range(LAYERS))
        pointers = _pointers(buffers)
    info = MLABufferInfo(
        buffers=buffers,
        data_ptrs=pointers,
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        kv_lora_rank=MLA_LORA,
        qk_rope_head_dim=MLA_ROPE,
        kv_cache_dim=width,
        **ON_CPU,
    )
    return _host(MLATokenToKVPoolHost, info, layout, allocator_type, label, target_layer_num=LAYERS)


def mamba(allocator_type: str) -> Any:
    """sglang's Mamba host pool takes no label: it is `mamba` by its class."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(LAYERS, 9, 4, 32), conv=(torch.zeros(LAYERS, 9, 8, 16),)
    )
    return MambaPoolHost(
        info,
        2.0,
        0,
        device_capacity=8,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator_type,
        layout="page_first",
    )


def build(kind: str, allocator_type: str, label: str) -> Any:
    """kind: mha:<layout>, mla:<layout>, mla_split, mamba."""
    family, _, layout = kind.partition(":")
    if family == "mha":
        return mha(layout, allocator_type, label)
    if family == "mla":
        return mla(layout, allocator_type, label)
    if family == "mla_split":
        return mla("page_first_kv_split", allocator_type, label, split=True)
    return mamba(allocator_type)
