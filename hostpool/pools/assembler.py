"""The hybrid assembler: a model's `config.json` plus server args -> every host pool it
needs, built through one HostPoolManager.

Pools, named as sglang's HostPoolGroup names them:
- `kv`: full-attention layers (MHA, or MLA when the config has `kv_lora_rank`);
- `swa`: sliding-window layers (`layer_types` with `sliding_attention`);
- `indexer`: DeepSeek sparse-attention indexer keys (`index_head_dim`), paged with `kv`;
- `mamba`: recurrent state of Mamba / linear-attention layers, page size 1.

Each pool is sized by sglang's rule on its own bytes per token (`layouts.size_pool`): as
in sglang, `hicache_size` applies to each pool, and `hicache_ratio` to each pool's device
size (`device_pool_size`; the SWA device pool is `swa_full_tokens_ratio` of it; the Mamba
device pool is `max_mamba_cache_size` states). The indexer's bytes count in `kv`'s
per-token size (sglang's NSA host pool does the same), and it follows `kv`'s pages.

`plan_host_pools` is pure (no memory): shapes and bytes for any model size.
`build_host_pools` allocates them; `assemble_host_pools` does both.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hostpool.allocators import get_allocator_type
from hostpool.errors import ConfigError, InvalidRequestError
from hostpool.manager import HostPoolManager, LeakReport
from hostpool.pools.freelist import SlotFreeList
from hostpool.pools.layouts import (
    LAYOUTS,
    Buffer,
    IndexerLayout,
    MambaLayout,
    MHALayout,
    MLALayout,
    PoolLayout,
    Sizing,
    size_pool,
)
from hostpool.pools.modelconfig import (
    _first,
    _int,
    _number,
    attention_layout,
    layer_kinds,
    load_model_config,
    mamba_layout,
    model_dtype,
)
from hostpool.storage.registry import resolve_allocator


@dataclass(frozen=True)
class HostPoolArgs:
    """The server args the assembler reads (sglang's names and defaults)."""

    hicache_ratio: float = 2.0
    hicache_size: float = 0.0  # GB (1e9 bytes), per pool; 0: use hicache_ratio
    page_size: int = 1
    hicache_mem_layout: str = "layer_first"
    hicache_storage_backend: str | None = None
    hicache_storage_backend_extra_config: Any = None
    device_pool_size: int | None = None  # tokens of the device KV pool
    swa_full_tokens_ratio: float = 0.8
    max_mamba_cache_size: int | None = None  # states of the device Mamba pool
    kv_cache_dtype: str | torch.dtype = "auto"
    mamba_ssm_dtype: str | torch.dtype = "float32"
    tp_size: int = 1

    @classmethod
    def from_server_args(cls, server_args: Any) -> HostPoolArgs:
        """From sglang's ServerArgs, any object with those attributes, or a dict."""
        if isinstance(server_args, HostPoolArgs):
            return server_args
        values: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if isinstance(server_args, Mapping):
                present, value = name in server_args, server_args.get(name)
            else:
                present = hasattr(server_args, name)
                value = getattr(server_args, name, None)
            if present and value is not None:
                values[name] = value
        args = cls(**values)
        args.validate()
        return args

    def validate(self) -> None:
        _number(self.hicache_ratio, "hicache_ratio", positive=True)
        _number(self.hicache_size, "hicache_size", positive=False)
        _number(self.swa_full_tokens_ratio, "swa_full_tokens_ratio", positive=True)
        _int(self.page_size, "page_size")
        _int(self.tp_size, "tp_size")
        for name in ("device_pool_size", "max_mamba_cache_size"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
        if self.hicache_mem_layout not in LAYOUTS:
            raise ConfigError(
                f"hicache_mem_layout must be one of {list(LAYOUTS)}, got "
                f"{self.hicache_mem_layout!r}"
            )


# -- model config --------------------------------------------------------------------
@dataclass(frozen=True)
class PoolPlan:
    name: str
    kind: str  # mha, mla, indexer, mamba
    layers: tuple[int, ...]  # the model's layer ids this pool holds
    layout: str
    sizing: Sizing
    bytes_per_token: int  # what sizing divided by (kv includes the indexer)
    buffers: tuple[Buffer, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


@dataclass(frozen=True)
class HostPoolPlan:
    model: str
    allocator: str  # a registered allocator name
    pools: tuple[PoolPlan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def pool(self, name: str) -> PoolPlan:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no pool {name!r} in this plan; pools: {[p.name for p in self.pools]}")


def plan_host_pools(
    config: Mapping[str, Any] | str | os.PathLike[str], server_args: Any
) -> HostPoolPlan:
    """Every host pool the model needs: layouts, sizes, dims and bytes. No memory."""
    cfg = load_model_config(config)
    args = HostPoolArgs.from_server_args(server_args)
    allocator = resolve_allocator(
        get_allocator_type(
            {
                "hicache_storage_backend": args.hicache_storage_backend,
                "hicache_storage_backend_extra_config": args.hicache_storage_backend_extra_config,
            }
        ),
        extra_config=args.hicache_storage_backend_extra_config,
    )
    kinds = layer_kinds(cfg)
    dtype = model_dtype(cfg, args.kv_cache_dtype)
    layout = args.hicache_mem_layout
    pools: list[PoolPlan] = []

    def add(name: str, layers: tuple[int, ...], pool: PoolLayout, sizing: Sizing, bpt: int) -> None:
        buffers = pool.buffers(layout, sizing)
        pools.append(PoolPlan(name, _pool_kind(pool), layers, layout, sizing, bpt, buffers))

    def sized(bpt: int, device_size: int | None, what: str, page_size: int) -> Sizing:
        return size_pool(
            bpt,
            page_size=page_size,
            hicache_size_gb=float(args.hicache_size),
            device_size=device_size,
            ratio=float(args.hicache_ratio),
            what=what,
        )

    full = tuple(i for i, k in enumerate(kinds) if k == "full")
    if full:
        kv = attention_layout(cfg, len(full), dtype, args.tp_size)
        indexer = None
        if cfg.get("index_head_dim") is not None and isinstance(kv, MLALayout):
            indexer = IndexerLayout(len(full), _int(cfg["index_head_dim"], "index_head_dim"))
        bpt = kv.bytes_per_token + (indexer.bytes_per_token if indexer else 0)
        sizing = sized(bpt, args.device_pool_size, "kv pool", args.page_size)
        add("kv", full, kv, sizing, bpt)
        if indexer is not None:
            add("indexer", full, indexer, sizing, indexer.bytes_per_token)
    swa = tuple(i for i, k in enumerate(kinds) if k == "swa")
    if swa:
        swa_kv = attention_layout(cfg, len(swa), dtype, args.tp_size)
        device = None
        if args.device_pool_size is not None:
            device = int(args.device_pool_size * args.swa_full_tokens_ratio)
        sizing = sized(swa_kv.bytes_per_token, device, "swa pool", args.page_size)
        add("swa", swa, swa_kv, sizing, swa_kv.bytes_per_token)
    mamba = tuple(i for i, k in enumerate(kinds) if k == "mamba")
    if mamba:
        # Conv states keep the model's dtype (not an fp8 KV dtype); SSM states default fp32.
        conv_dtype = model_dtype(cfg)
        ssm_dtype = model_dtype(cfg, args.mamba_ssm_dtype)
        state = mamba_layout(cfg, len(mamba), conv_dtype, ssm_dtype, args.tp_size)
        sizing = sized(state.bytes_per_token, args.max_mamba_cache_size, "mamba pool", 1)
        add("mamba", mamba, state, sizing, state.bytes_per_token)
    if not pools:
        raise ConfigError("the model has no KV or state layers: nothing to put in host pools")
    name = str(_first(cfg, "_name_or_path", "model_type", default="model"))
    return HostPoolPlan(model=name, allocator=allocator, pools=tuple(pools))


def _pool_kind(pool: PoolLayout) -> str:
    kinds = {MHALayout: "mha", MLALayout: "mla", IndexerLayout: "indexer", MambaLayout: "mamba"}
    return kinds[type(pool)]


# -- building ------------------------------------------------------------------------
@dataclass
class HostPool:
    """One built pool: its buffers (by name) and, for independently indexed pools, its
    slot free-list (the indexer is indexed by `kv`'s pages)."""

    plan: PoolPlan
    buffers: dict[str, torch.Tensor]
    free_slots: SlotFreeList | None

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def buffer(self) -> torch.Tensor:
        """The pool's first buffer (the only one, except for Mamba)."""
        return next(iter(self.buffers.values()))

    @property
    def k_buffer(self) -> torch.Tensor:
        return self._mha()[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self._mha()[1]

    def _mha(self) -> torch.Tensor:
        if self.plan.kind != "mha":
            raise AttributeError(f"pool {self.name!r} is {self.plan.kind}, not MHA: no K/V halves")
        return self.buffers["kv"]


@dataclass
class HostPools:
    """Every pool of a model, made by one HostPoolManager. `close()` releases them."""

    plan: HostPoolPlan
    manager: HostPoolManager
    pools: dict[str, HostPool] = field(default_factory=dict)
    owns_manager: bool = False

    def __getitem__(self, name: str) -> HostPool:
        return self.pools[name]

    def __contains__(self, name: object) -> bool:
        return name in self.pools

    def close(self) -> LeakReport:
        """Release every buffer explicitly, then drop this object's references: what
        stays mapped after that is held by someone else (the LeakReport, when this
        object made the manager)."""
        pools, self.pools = self.pools, {}
        for pool in pools.values():
            _release(self.manager, pool)
        del pools
        return self.manager.close() if self.owns_manager else LeakReport()

    def __enter__(self) -> HostPools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(manager: HostPoolManager, pool: HostPool) -> None:
    # Its own frame: no tensor stays bound in the caller's locals after this returns.
    allocator = manager.allocator_for(pool.name)
    if allocator is not None:
        for tensor in pool.buffers.values():
            with contextlib.suppress(InvalidRequestError):  # released already
                allocator.release(tensor)
    pool.buffers.clear()


def build_host_pools(
    plan: HostPoolPlan,
    manager: HostPoolManager | None = None,
    **allocator_options: Any,
) -> HostPools:
    """Allocate every buffer of `plan`, all through one manager (a new one if None).

    On failure nothing stays allocated: buffers made so far are released before raising.
    """
    owns = manager is None
    mgr = manager if manager is not None else HostPoolManager()
    built = HostPools(plan=plan, manager=mgr, owns_manager=owns)
    tensors: dict[str, torch.Tensor] = {}
    try:
        for pool in plan.pools:
            allocator = mgr.allocator(pool.name, plan.allocator, **allocator_options)
            slots = None
            if pool.kind != "indexer":  # indexed by kv's pages
                slots = SlotFreeList(pool.sizing.size, pool.sizing.page_size)
            tensors = {}
            built.pools[pool.name] = HostPool(pool, tensors, slots)
            for b in pool.buffers:
                tensors[b.name] = allocator.allocate(b.dims, b.dtype)
    except BaseException:
        built.close()
        tensors.clear()  # the traceback keeps this frame: hold no tensor in it
        raise
    return built


def assemble_host_pools(
    config: Mapping[str, Any] | str | os.PathLike[str],
    server_args: Any,
    manager: HostPoolManager | None = None,
    **allocator_options: Any,
) -> HostPools:
    """`plan_host_pools` then `build_host_pools`."""
    return build_host_pools(plan_host_pools(config, server_args), manager, **allocator_options)


# -- helpers -------------------------------------------------------------------------
