"""`HostpoolOffloadingSpec`: vLLM's CPU KV offload memory as a hostpool memfd pool.

vLLM loads it through its own `kv_connector_extra_config` for the `OffloadingConnector`,
with no change to vLLM's source::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_module_path": "hostpool.integrations.vllm",
        "spec_name": "HostpoolOffloadingSpec", "cpu_bytes_to_use": 4294967296}}'

It is vLLM's `CPUOffloadingSpec` (same scheduler-side manager, same sizing from
`cpu_bytes_to_use`, same `vllm:kv_offload_*` metrics) except for where the host memory
comes from and who copies:

- The memory is ONE region per worker, made by `HostPoolManager().allocator(pool, "shm",
  **options).allocate(...)`: a memfd named `hostpool.<pool>.<pid>.<seq>`, sealed, 0600,
  populated in parallel, admitted by the budget, in the process ledger (metrics, events,
  `hostpool inspect`). Each tensor-parallel rank has its own region (vLLM's stock spec
  shares one `/dev/shm` file between ranks by path; `HOSTPOOL_INSTRUMENT=vllm` keeps that).
- On CUDA-alike and XPU platforms the region is handed to vLLM's own `CPUOffloadingWorker`
  (its copy kernels; pinning stays vLLM's: it host-registers the region as it does its own).
- On any other platform (CPU), where vLLM's worker refuses to run, `HostCopyWorker` copies
  blocks with torch index ops, synchronously, so offloading works end to end.
- The region is released explicitly when vLLM shuts the worker down
  (`Worker.shutdown` -> `ensure_kv_transfer_shutdown` -> connector -> `OffloadingWorker.shutdown`),
  counted `how="explicit"`; a `finalizer` release would mean that hook never ran.
  The worker logs one line through vLLM's logger saying so, with the pool's release counts.

Options (all optional, in `kv_connector_extra_config`; anything else starting `hostpool_`
is a `ConfigError`):

| key | meaning |
| --- | --- |
| `hostpool_pool` | pool label, default `vllm_offload` (broker: rank k of n `<pool>-rank<k>`) |
| `hostpool_broker` | `hostpool serve --share-socket PATH`: lease the pool, keep the index there |

With `hostpool_broker` (docs/broker.md) the worker's memory is leased from the broker's
pool instead of allocated (a pool smaller than the worker needs is one clear error), and
the scheduler's index (OffloadKey -> chunk) is kept in the broker, adopted by the next
engine of the same identity. The allocator options and `hostpool_budget` are then the
broker pool's: refused here.
| `hostpool_hugepages` | `off`, `prefer`, `required` |
| `hostpool_hugepage_size` | `2MB`, `1GB` or bytes |
| `hostpool_populate` | `auto`, `madvise`, `map_populate`, `touch`, `none` |
| `hostpool_populate_threads` | threads that populate the region |
| `hostpool_numa_node` | NUMA node to bind the region to |
| `hostpool_shm_backend` | `auto`, `memfd`, `devshm` |
| `hostpool_fallback_dir` | directory of the `/dev/shm`-style fallback |
| `hostpool_budget` | byte budget of the engine's manager (bytes or `4GiB`) |
| `hostpool_metrics_dir` | where workers publish metrics for vLLM's `/metrics` |

Metrics: see `hostpool.integrations.vllm.metrics_route` (the worker publishes, vLLM's
API-server process serves them on its own `/metrics`).
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from typing import Any

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from hostpool.base.units import parse_size
from hostpool.errors import ConfigError
from hostpool.integrations.vllm import internals as vllm_internals
from hostpool.integrations.vllm import metrics_route, persist
from hostpool.integrations.vllm.offload import (
    BrokerRegion,
    HostCopyWorker,
    HostpoolRegion,
    OffloadMemory,
)
from hostpool.memory.options import RegionOptions, validate_pool_name

# Under vLLM's logger tree, so the lines appear in the server's log as vLLM's own do.
logger = init_logger(f"vllm.{__name__}")

DEFAULT_POOL = "vllm_offload"
# extra_config key -> allocator option
ALLOCATOR_OPTIONS = {
    "hostpool_hugepages": "hugepages",
    "hostpool_hugepage_size": "hugepage_size",
    "hostpool_populate": "populate",
    "hostpool_populate_threads": "populate_threads",
    "hostpool_numa_node": "numa_node",
    "hostpool_shm_backend": "shm_backend",
    "hostpool_fallback_dir": "fallback_dir",
}
OTHER_OPTIONS = {"hostpool_pool", "hostpool_budget", "hostpool_metrics_dir", "hostpool_broker"}


def hostpool_options(extra_config: Mapping[str, Any]) -> tuple[str, RegionOptions, int | None]:
    """(pool, allocator options, budget bytes or None) from `kv_connector_extra_config`.

    Raises ConfigError for an unknown `hostpool_*` key and InvalidRequestError (hostpool's
    usual error for them) for a bad pool name or option value."""
    unknown = sorted(
        k
        for k in extra_config
        if isinstance(k, str)
        and k.startswith("hostpool_")
        and k not in ALLOCATOR_OPTIONS
        and k not in OTHER_OPTIONS
    )
    if unknown:
        known = ", ".join(sorted({*ALLOCATOR_OPTIONS, *OTHER_OPTIONS}))
        raise ConfigError(f"unknown kv_connector_extra_config key(s) {unknown}; known: {known}")
    pool = validate_pool_name(extra_config.get("hostpool_pool", DEFAULT_POOL))
    # parsed once, here: bad values fail when vLLM builds the connector
    options = RegionOptions.parse(
        **{
            option: extra_config[key]
            for key, option in ALLOCATOR_OPTIONS.items()
            if key in extra_config
        }
    )
    budget = extra_config.get("hostpool_budget")
    return pool, options, None if budget is None else parse_size(budget, what="hostpool_budget")


class HostpoolSharedRegion(SharedOffloadRegion):
    """A `HostpoolRegion` in the shape vLLM 0.32's `CPUOffloadingWorker` expects of its
    `SharedOffloadRegion` (rank 0 slot of a worker-private region): vLLM's worker makes
    its views, pins and unpins it; `cleanup()` (called by that worker's `shutdown()`)
    does vLLM's part, then releases the hostpool region explicitly.

    It does not call `SharedOffloadRegion.__init__` (which creates a `/dev/shm` file); it
    sets the attributes vLLM's worker and `pin_mmap_region` read (`internals`)."""

    def __init__(self, region: OffloadMemory) -> None:
        self.hostpool_region = region
        vllm_internals.fill_worker_private(self, region.base, region.num_chunks, region.row_bytes)

    def cleanup(self) -> None:
        super().cleanup()
        self.hostpool_region.release()


def broker_path(extra_config: Mapping[str, Any]) -> str | None:
    """`hostpool_broker`, checked: a path, and no allocator option beside it."""
    path = extra_config.get("hostpool_broker")
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"hostpool_broker must be a socket path, got {path!r}")
    local = sorted(k for k in (*ALLOCATOR_OPTIONS, "hostpool_budget") if k in extra_config)
    if local:
        raise ConfigError(
            f"{local} with hostpool_broker: the broker's pool has its own options "
            "(hostpool serve's [pools.NAME]); remove them here"
        )
    return path


class HostpoolOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with its host memory in a hostpool pool (module doc)."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        # Called by vLLM's Prometheus stat logger in the API-server process: the place
        # where hostpool's collector joins vLLM's /metrics (metrics_route).
        metrics_route.serve_on_vllm_metrics(extra_config)
        definitions: dict[str, OffloadingMetricMetadata] = super().build_metric_definitions(
            extra_config
        )
        return definitions

    def __init__(self, config: OffloadingConfig) -> None:
        self.pool, self.allocator_options, self.budget = hostpool_options(config.extra_config)
        self.broker = broker_path(config.extra_config)
        super().__init__(config)
        self.region: OffloadMemory | None = None  # this worker's, once get_worker ran
        self._broker_manager: OffloadingManager | None = None
        self._hostpool_worker: OffloadingWorker | None = None

    def _uses_shared_region(self) -> bool:
        # Each rank has its own hostpool region: no cross-rank shared file, no replicated
        # (single-copy) layout.
        return False

    def get_manager(self) -> OffloadingManager:
        """vLLM's manager, or with `hostpool_broker` the same manager keeping its index in
        the broker (`persist.BrokerIndexManager`)."""
        if self.broker is None:
            manager: OffloadingManager = super().get_manager()
            return manager
        if self._broker_manager is None:
            parallel = self.config.parallel
            self._broker_manager = persist.BrokerIndexManager(
                broker=self.broker,
                pool=persist.rank_pool(self.pool, parallel.world_size, 0),
                config=self.config,
                spec=self,
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            )
        return self._broker_manager

    def _uses_vllm_worker(self) -> bool:
        """Whether vLLM's own copy worker runs on this platform (the stock spec's test)
        and is one whose region internals hostpool was read from (else `HostCopyWorker`,
        after one `hostpool.untested_version` warning)."""
        on_device = bool(current_platform.is_cuda_alike() or current_platform.is_xpu())
        return on_device and vllm_internals.supported()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._hostpool_worker is not None:
            return self._hostpool_worker
        per_chunk = sum(t.page_size_bytes for t in kv_caches.tensors) * self.blocks_per_chunk
        page = mmap.PAGESIZE
        row_bytes = -(-max(per_chunk, self.cpu_page_size_per_worker, 1) // page) * page
        num_chunks = max(self.num_chunks, 1)
        region: OffloadMemory
        if self.broker is not None:
            parallel = self.config.parallel
            pool = persist.rank_pool(self.pool, parallel.world_size, parallel.rank)
            region = BrokerRegion(self.broker, pool, num_chunks, row_bytes)
        else:
            region = HostpoolRegion(
                self.pool, num_chunks, row_bytes, self.allocator_options, self.budget
            )
        self.region = region
        try:
            worker: OffloadingWorker
            if self._uses_vllm_worker():
                shared = HostpoolSharedRegion(region)
                worker = CPUOffloadingWorker(
                    kv_caches=kv_caches,
                    blocks_per_chunk=self.blocks_per_chunk,
                    num_cpu_chunks=num_chunks,
                    mmap_region=shared,
                )
            else:
                worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region, region.release)
            metrics_route.worker_region_made(self.extra_config)
        except BaseException:
            region.release()
            raise
        logger.info(
            "hostpool: offload pool %s: %d chunks x %d bytes (%d bytes) in %s",
            region.pool,
            num_chunks,
            row_bytes,
            region.nbytes,
            "vLLM's CPUOffloadingWorker" if self._uses_vllm_worker() else "HostCopyWorker",
        )
        self._hostpool_worker = worker
        return worker
