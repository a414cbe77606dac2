"""Reading a Hugging Face `config.json`: layer kinds, dtype, and the attention and Mamba
layouts a model's host pools need. Pure functions over the parsed JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from hostpool.errors import ConfigError
from hostpool.pools.layouts import (
    MambaLayout,
    MHALayout,
    MLALayout,
)

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
