"""The host KV memory an engine's command line asks for, as `PoolNeed`s.

Read from the flags of the pinned engines (tests/test_kubernetes.py checks each flag
read here against their own parsers), without importing either:

- vLLM 0.32 (`vllm serve ...`, `python -m vllm.entrypoints.openai.api_server ...`):
  `--kv-offloading-size` GiB, summed over the tensor- and pipeline-parallel ranks, with
  `--kv-offloading-backend native` (the default), or `cpu_bytes_to_use` in an
  `OffloadingConnector`'s `--kv-transfer-config`. vLLM's own spec keeps it in one
  /dev/shm file the ranks share (`vllm_offload_*.mmap`); `HostpoolOffloadingSpec` in one
  memfd per rank (a /dev/shm file with `hostpool_shm_backend: devshm`), in hugetlb pages
  with `hostpool_hugepages`. The lmcache backend keeps its memory in its own server.
- sglang 0.5.23 (`python -m sglang.launch_server ...`): `--enable-hierarchical-cache`
  with `--hicache-size` GB (10^9 bytes) per rank, ranks = tp x pp (x dp without
  `--enable-dp-attention`). A host pool sized by `--hicache-ratio` (or sglang's default
  ratio) follows the GPU's KV pool, known only at run time: refused, naming
  `--hicache-size`. The backing (a memfd with `--hicache-storage-backend shm`, else
  private memory) changes no figure: both are charged to the pod's memory.

A command line these cannot size is a ConfigError naming what is missing (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from hostpool.core.podplan import Backing, PoolNeed
from hostpool.errors import ConfigError, HostPoolError
from hostpool.memory.options import RegionOptions

GIB = 1 << 30
GB = 10**9
HOSTPOOL_SPEC = "HostpoolOffloadingSpec"
DEFAULT_VLLM_POOL = "vllm_offload"  # vLLM's region and hostpool's spec use this pool name
# HostpoolOffloadingSpec's allocator keys that decide where the bytes live
SPEC_KEYS = ("hugepages", "hugepage_size", "shm_backend", "numa_node")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise ConfigError(f"engine command line: {message}")


def engine_of(argv: Sequence[str]) -> str:
    """'vllm' or 'sglang', from the program or module the command line runs."""
    for word in argv[:4]:
        base = os.path.basename(word)
        if base == "vllm" or word.startswith("vllm."):
            return "vllm"
        if base == "sglang" or word.startswith("sglang."):
            return "sglang"
    raise ConfigError(
        "cannot tell the engine of this command line: it runs neither vllm "
        "(vllm serve, python -m vllm.entrypoints...) nor sglang (python -m sglang.launch_server)"
    )


def needs_from_command(argv: Sequence[str]) -> list[PoolNeed]:
    """The pools an engine command line asks for (ConfigError when it asks for none); a
    `hostpool run ... -- CMD` wrapper (as a pod's command has it) is looked through."""
    if argv and os.path.basename(argv[0]) == "hostpool" and "--" in argv:
        argv = argv[list(argv).index("--") + 1 :]
    if engine_of(argv) == "vllm":
        return vllm_needs(argv)
    return sglang_needs(argv)


def _int_flag(p: argparse.ArgumentParser, *names: str) -> None:
    p.add_argument(*names, type=int, default=1)


def vllm_needs(argv: Sequence[str]) -> list[PoolNeed]:
    p = _Parser(add_help=False, allow_abbrev=False)
    p.add_argument("--kv-offloading-size", type=float)
    p.add_argument("--kv-offloading-backend", default="native")
    p.add_argument("--kv-transfer-config")
    _int_flag(p, "--tensor-parallel-size", "-tp")
    _int_flag(p, "--pipeline-parallel-size", "-pp")
    args, _ = p.parse_known_args(list(argv))
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    transfer = _json_flag(args.kv_transfer_config, "--kv-transfer-config")
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
    if args.kv_offloading_size is not None:
        if args.kv_offloading_backend != "native":
            raise ConfigError(
                f"--kv-offloading-backend {args.kv_offloading_backend}: its KV memory lives "
                "in its own server, not in this pod; size that server's pod"
            )
        size = int(args.kv_offloading_size * GIB)
        source = f"--kv-offloading-size {args.kv_offloading_size:g} (GiB)"
    elif transfer.get("kv_connector") == "OffloadingConnector" and "cpu_bytes_to_use" in extra:
        size = _whole(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
        source = "--kv-transfer-config cpu_bytes_to_use"
    else:
        raise ConfigError(
            "this vLLM command line asks for no host KV memory: no --kv-offloading-size "
            "and no OffloadingConnector with cpu_bytes_to_use in --kv-transfer-config"
        )
    if size <= 0:
        raise ConfigError(f"{source}: the size must be positive")
    if extra.get("spec_name") != HOSTPOOL_SPEC:
        # vLLM's SharedOffloadRegion: one /dev/shm file, mapped by every rank
        return [PoolNeed(DEFAULT_VLLM_POOL, size, "devshm", mappings=ranks, source=source)]
    pool = str(extra.get("hostpool_pool", DEFAULT_VLLM_POOL))
    try:
        options = RegionOptions.parse(
            **{k: extra[f"hostpool_{k}"] for k in SPEC_KEYS if f"hostpool_{k}" in extra}
        )
    except HostPoolError as exc:
        raise ConfigError(f"--kv-transfer-config: {exc}") from None
    backing: Backing = "devshm" if options.shm_backend == "devshm" else "memfd"
    return [
        PoolNeed(
            pool,
            size,
            backing,
            hugepages=options.hugepages,
            hugepage_size=options.hugepage_size,
            mappings=ranks,  # one region per rank
            numa_node=options.numa_node,
            source=f"{source}, {HOSTPOOL_SPEC}",
        )
    ]


def sglang_needs(argv: Sequence[str]) -> list[PoolNeed]:
    p = _Parser(add_help=False, allow_abbrev=False)
    p.add_argument("--enable-hierarchical-cache", "--enable-hicache", action="store_true")
    p.add_argument("--hicache-size", type=int, default=0)
    p.add_argument("--hicache-ratio", type=float)
    p.add_argument("--hicache-storage-backend")
    p.add_argument("--enable-dp-attention", action="store_true")
    _int_flag(p, "--tp-size", "--tensor-parallel-size")
    _int_flag(p, "--pp-size", "--pipeline-parallel-size")
    _int_flag(p, "--dp-size", "--data-parallel-size")
    args, _ = p.parse_known_args(list(argv))
    if not args.enable_hierarchical_cache:
        raise ConfigError(
            "this sglang command line asks for no host KV cache (no --enable-hierarchical-cache)"
        )
    if args.hicache_size <= 0:
        raise ConfigError(
            "sglang sizes this host pool by --hicache-ratio from the GPU's KV pool, known only "
            "at run time: give --hicache-size GB (per rank) to size the pod"
        )
    ranks = args.tp_size * args.pp_size * (1 if args.enable_dp_attention else args.dp_size)
    backing: Backing = "memfd" if args.hicache_storage_backend == "shm" else "anon"
    return [
        PoolNeed(
            "hicache",
            args.hicache_size * GB * ranks,
            backing,
            mappings=ranks,
            source=f"--hicache-size {args.hicache_size} (GB) x {ranks} ranks",
        )
    ]


def _json_flag(text: str | None, flag: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: must be a JSON object")
    return value


def _whole(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ConfigError(f"{what} must be a whole number of bytes, got {value!r}")
    return int(value)
