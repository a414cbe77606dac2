"""Host KV pool layouts and sizing, as sglang's host pools make them.

A pool is one or more buffers whose dims depend on the layout:

| pool    | layer_first           | page_first            | page_first_direct                 |
| ------- | --------------------- | --------------------- | --------------------------------- |
| MHA     | (2, L, size, H, D)    | (2, size, L, H, D)    | (2, page_num, L, page_size, H, D) |
| MLA     | (L, size, 1, kv_dim)  | (size, L, 1, kv_dim)  | (page_num, L, page_size, 1, kv_dim) |
| Mamba   | (L, size, *state)     | (size, L, 1, *state)  | (size, L, 1, *state)              |

MHA also has sglang's `page_head` (2, page_num, H, page_size, L, D). Mamba pools have a
page size of 1 and one buffer per state (temporal, then each conv state). The DeepSeek
sparse-attention indexer keeps `(L, page_num, page_size * per_token_bytes)` uint8 (fp8
keys plus one fp32 scale per 128 values), one page ahead of the KV pool as sglang sizes it.

Sizing: tokens = `int(hicache_size_GB * 1e9 // bytes_per_token)`, else
`int(device_pool_size * hicache_ratio)`; then `page_num = tokens // page_size + 1` and
`size = page_num * page_size` (always at least one page more than asked, as sglang does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from hostpool.errors import ConfigError

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
KV_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
INDEXER_QUANT_BLOCK = 128  # fp8 indexer keys carry one fp32 scale per 128 values


@dataclass(frozen=True)
class Buffer:
    """One tensor of a pool."""

    name: str
    dims: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * self.dtype.itemsize


@dataclass(frozen=True)
class Sizing:
    size: int  # slots (tokens, or states for Mamba)
    page_num: int
    page_size: int


class PoolLayout(Protocol):
    @property
    def bytes_per_token(self) -> int: ...

    def buffers(self, layout: str, sizing: Sizing) -> tuple[Buffer, ...]: ...


def size_pool(
    bytes_per_token: int,
    *,
    page_size: int,
    hicache_size_gb: float = 0.0,
    device_size: int | None = None,
    ratio: float = 2.0,
    what: str = "pool",
) -> Sizing:
    """sglang's host pool sizing (see the module docstring)."""
    _positive(page_size, "page_size")
    _positive(bytes_per_token, f"{what} bytes per token")
    if hicache_size_gb > 0:
        tokens = int(hicache_size_gb * 1e9 // bytes_per_token)
    elif device_size is not None:
        if device_size < 0 or ratio <= 0:
            raise ConfigError(
                f"{what}: device pool size must be >= 0 and hicache_ratio > 0; got "
                f"{device_size} and {ratio}"
            )
        tokens = int(device_size * ratio)
    else:
        raise ConfigError(
            f"{what}: set hicache_size (GB) or give the device pool size to apply hicache_ratio to"
        )
    page_num = tokens // page_size + 1
    return Sizing(size=page_num * page_size, page_num=page_num, page_size=page_size)


def check_layout(layout: str, allowed: tuple[str, ...], what: str) -> str:
    if layout not in allowed:
        raise ConfigError(f"{what} pools support layouts {list(allowed)}, not {layout!r}")
    return layout


@dataclass(frozen=True)
class MHALayout:
    layer_num: int
    head_num: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("layer_num", "head_num", "head_dim"):
            _positive(getattr(self, name), f"MHA {name}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize

    def buffers(self, layout: str, sizing: Sizing) -> tuple[Buffer, ...]:
        L, H, D = self.layer_num, self.head_num, self.head_dim
        dims = {
            "layer_first": (2, L, sizing.size, H, D),
            "page_first": (2, sizing.size, L, H, D),
            "page_first_direct": (2, sizing.page_num, L, sizing.page_size, H, D),
            "page_head": (2, sizing.page_num, H, sizing.page_size, L, D),
        }[check_layout(layout, LAYOUTS, "MHA")]
        return (Buffer("kv", dims, self.dtype),)


@dataclass(frozen=True)
class MLALayout:
    layer_num: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("layer_num", "kv_lora_rank", "qk_rope_head_dim"):
            _positive(getattr(self, name), f"MLA {name}")

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.layer_num * self.kv_dim * self.dtype.itemsize

    def buffers(self, layout: str, sizing: Sizing) -> tuple[Buffer, ...]:
        L, K = self.layer_num, self.kv_dim
        dims = {
            "layer_first": (L, sizing.size, 1, K),
            "page_first": (sizing.size, L, 1, K),
            "page_first_direct": (sizing.page_num, L, sizing.page_size, 1, K),
        }[check_layout(layout, KV_LAYOUTS, "MLA")]
        return (Buffer("kv", dims, self.dtype),)


@dataclass(frozen=True)
class IndexerLayout:
    """DeepSeek sparse attention's indexer keys, paged alongside the KV pool."""

    layer_num: int
    index_head_dim: int
    quant_block_size: int = INDEXER_QUANT_BLOCK

    def __post_init__(self) -> None:
        for name in ("layer_num", "index_head_dim", "quant_block_size"):
            _positive(getattr(self, name), f"indexer {name}")

    @property
    def token_bytes(self) -> int:
        """Per layer and token: fp8 values plus a 4-byte scale per quant block."""
        return self.index_head_dim + self.index_head_dim // self.quant_block_size * 4

    @property
    def bytes_per_token(self) -> int:
        return self.layer_num * self.token_bytes

    def buffers(self, layout: str, sizing: Sizing) -> tuple[Buffer, ...]:
        # Page-indexed whatever the KV layout; sglang sizes it one page beyond the KV pool.
        page_num = (sizing.size + sizing.page_size + 1) // sizing.page_size
        dims = (self.layer_num, page_num, sizing.page_size * self.token_bytes)
        return (Buffer("index_k", dims, torch.uint8),)


@dataclass(frozen=True)
class MambaLayout:
    """Recurrent state per slot: one temporal (SSM) state and conv states, per layer."""

    layer_num: int
    conv_shapes: tuple[tuple[int, ...], ...]
    temporal_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    temporal_dtype: torch.dtype

    def __post_init__(self) -> None:
        _positive(self.layer_num, "mamba layer_num")
        for shape in (*self.conv_shapes, self.temporal_shape):
            for d in shape:
                _positive(d, "mamba state dim")

    @property
    def bytes_per_token(self) -> int:
        conv = sum(math.prod(s) for s in self.conv_shapes) * self.conv_dtype.itemsize
        temporal = math.prod(self.temporal_shape) * self.temporal_dtype.itemsize
        return (conv + temporal) * self.layer_num

    def buffers(self, layout: str, sizing: Sizing) -> tuple[Buffer, ...]:
        check_layout(layout, KV_LAYOUTS, "Mamba")
        L, size = self.layer_num, sizing.size

        def dims(shape: tuple[int, ...]) -> tuple[int, ...]:
            return (L, size, *shape) if layout == "layer_first" else (size, L, 1, *shape)

        out = [Buffer("temporal", dims(self.temporal_shape), self.temporal_dtype)]
        out += [
            Buffer(f"conv{i}", dims(shape), self.conv_dtype)
            for i, shape in enumerate(self.conv_shapes)
        ]
        return tuple(out)


def _positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")
