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
import json
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
from hostpool.storage.registry import resolve_allocator

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    # sglang stores fp8 KV as uint8 (`store_dtype`): same bytes, no fp8 ops needed.
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
}
# Layer kinds: "full" and "swa" attention hold KV; "mamba" holds recurrent state;
# "none" (MLP/MoE-only blocks) holds nothing.
_LAYER_TYPES = {
    "full_attention": "full",
    "attention": "full",
    "chunked_attention": "full",
    "sliding_attention": "swa",
    "mamba": "mamba",
    "linear_attention": "mamba",
    "mlp": "none",
    "moe": "none",
}
_PATTERN = {"M": "mamba", "*": "full", "-": "none", "E": "none"}  # Nemotron-H


# -- server args ---------------------------------------------------------------------
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
def load_model_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A Hugging Face config as a dict (the text config of a multimodal one)."""
    if isinstance(config, Mapping):
        data = dict(config)
    else:
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"model config {path} is not a JSON object")
    text = data.get("text_config")
    return {**data, **text} if isinstance(text, dict) else data


def layer_kinds(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """Per layer: `full`, `swa`, `mamba` or `none`, from whichever field the model uses."""
    n = _int(cfg.get("num_hidden_layers"), "num_hidden_layers")
    if isinstance(cfg.get("layer_types"), list):
        kinds = [_kind(t, "layer_types") for t in cfg["layer_types"]]
    elif isinstance(cfg.get("hybrid_override_pattern"), str):
        kinds = [
            _kind(c, "hybrid_override_pattern", _PATTERN) for c in cfg["hybrid_override_pattern"]
        ]
    elif isinstance(cfg.get("layers_block_type"), list):
        kinds = [_kind(t, "layers_block_type") for t in cfg["layers_block_type"]]
    elif "attn_layer_period" in cfg:  # Jamba: one attention layer per period
        period = _int(cfg["attn_layer_period"], "attn_layer_period")
        offset = int(cfg.get("attn_layer_offset", 0))
        kinds = ["full" if i % period == offset else "mamba" for i in range(n)]
    elif "full_attention_interval" in cfg:  # Qwen3-Next: every k-th layer is full
        k = _int(cfg["full_attention_interval"], "full_attention_interval")
        kinds = ["full" if (i + 1) % k == 0 else "mamba" for i in range(n)]
    else:
        kinds = ["full"] * n
    if len(kinds) != n:
        raise ConfigError(f"the layer list has {len(kinds)} entries for {n} num_hidden_layers")
    return tuple(kinds)


def _kind(value: object, field_name: str, table: Mapping[str, str] = _LAYER_TYPES) -> str:
    kind = table.get(value) if isinstance(value, str) else None
    if kind is None:
        raise ConfigError(f"{field_name}: unknown layer type {value!r}; known: {sorted(table)}")
    return kind


def _first(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def model_dtype(cfg: Mapping[str, Any], requested: str | torch.dtype = "auto") -> torch.dtype:
    if isinstance(requested, torch.dtype):
        return requested
    name = (
        _first(cfg, "torch_dtype", "dtype", default="bfloat16")
        if requested == "auto"
        else requested
    )
    dtype = _DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ConfigError(f"unsupported KV cache dtype {name!r}; known: {sorted(_DTYPES)}")
    return dtype


def attention_layout(
    cfg: Mapping[str, Any], layers: int, dtype: torch.dtype, tp_size: int
) -> MHALayout | MLALayout:
    if cfg.get("kv_lora_rank") is not None:  # MLA: one latent per token, shared by ranks
        return MLALayout(
            layer_num=layers,
            kv_lora_rank=_int(cfg["kv_lora_rank"], "kv_lora_rank"),
            qk_rope_head_dim=_int(cfg.get("qk_rope_head_dim"), "qk_rope_head_dim"),
            dtype=dtype,
        )
    heads = _int(cfg.get("num_attention_heads"), "num_attention_heads")
    kv_heads = _int(_first(cfg, "num_key_value_heads", default=heads), "num_key_value_heads")
    head_dim = _first(cfg, "head_dim", "attention_head_dim")
    if head_dim is None:
        head_dim = _int(cfg.get("hidden_size"), "hidden_size") // heads
    # Ranks split the KV heads; with more ranks than heads each rank keeps a replica.
    return MHALayout(
        layer_num=layers,
        head_num=max(1, kv_heads // tp_size),
        head_dim=_int(head_dim, "head_dim"),
        dtype=dtype,
    )


def mamba_layout(
    cfg: Mapping[str, Any],
    layers: int,
    conv_dtype: torch.dtype,
    temporal_dtype: torch.dtype,
    tp_size: int,
) -> MambaLayout:
    """State shapes as sglang's Mamba2StateShape (Nemotron-H, Granite, Falcon-H1,
    Qwen3-Next's gated delta net) or Mamba-1 (Jamba)."""
    conv: tuple[int, ...]
    temporal: tuple[int, ...]
    heads = _first(cfg, "mamba_num_heads", "mamba_n_heads", "linear_num_value_heads")
    if heads is not None:
        if "linear_num_value_heads" in cfg and "mamba_num_heads" not in cfg:
            head_dim = cfg.get("linear_value_head_dim")
            state = cfg.get("linear_key_head_dim")
            groups = cfg.get("linear_num_key_heads")
            kernel = cfg.get("linear_conv_kernel_dim")
        else:
            head_dim = _first(cfg, "mamba_head_dim", "mamba_d_head")
            state = _first(cfg, "ssm_state_size", "mamba_d_state", "mamba_state_dim")
            groups = _first(cfg, "n_groups", "mamba_n_groups", "mamba_num_groups", default=1)
            kernel = _first(cfg, "conv_kernel", "mamba_d_conv", default=4)
        heads, head_dim = _int(heads, "mamba heads"), _int(head_dim, "mamba head dim")
        state, groups = _int(state, "mamba state size"), _int(groups, "mamba groups")
        kernel = _int(kernel, "mamba conv kernel")
        if groups % tp_size:  # sglang replicates groups so each head shard has its own
            groups += tp_size - groups
        conv_dim = heads * head_dim + 2 * groups * state
        conv = (_divide(conv_dim, tp_size), kernel - 1)
        temporal = (_divide(heads, tp_size), head_dim, state)
    elif cfg.get("mamba_d_state") is not None:  # Mamba-1: per-channel state
        inner = int(cfg.get("mamba_expand", 2)) * _int(cfg.get("hidden_size"), "hidden_size")
        kernel = _int(cfg.get("mamba_d_conv", 4), "mamba_d_conv")
        conv = (_divide(inner, tp_size), kernel - 1)
        temporal = (_divide(inner, tp_size), _int(cfg["mamba_d_state"], "mamba_d_state"))
    else:
        raise ConfigError(
            "the config has Mamba layers but no state fields (mamba_num_heads/mamba_n_heads, "
            "ssm_state_size/mamba_d_state, linear_num_value_heads, ...)"
        )
    return MambaLayout(layers, (conv,), temporal, conv_dtype, temporal_dtype)


# -- the plan ------------------------------------------------------------------------
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
def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")
    return value


def _number(value: object, what: str, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{what} must be {'positive' if positive else '>= 0'}, got {value!r}")


def _divide(n: int, by: int) -> int:
    if n % by:
        raise ConfigError(f"{n} does not split evenly over tp_size {by}")
    return n // by
