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
| `hostpool_pool` | pool label, default `vllm_offload` |
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
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingMetricMetadata,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from hostpool.base.units import parse_size
from hostpool.core.ledger import get_ledger
from hostpool.core.manager import HostPoolManager
from hostpool.errors import ConfigError
from hostpool.integrations.vllm import metrics_route
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
OTHER_OPTIONS = {"hostpool_pool", "hostpool_budget", "hostpool_metrics_dir"}


def hostpool_options(extra_config: Mapping[str, Any]) -> tuple[str, dict[str, Any], int | None]:
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
    options = {
        option: extra_config[key]
        for key, option in ALLOCATOR_OPTIONS.items()
        if key in extra_config
    }
    RegionOptions.parse(**options)  # bad values fail here, when vLLM builds the connector
    budget = extra_config.get("hostpool_budget")
    return pool, options, None if budget is None else parse_size(budget, what="hostpool_budget")


class HostpoolRegion:
    """One worker's offload memory: a hostpool region of `num_chunks` rows of `row_bytes`.

    Owns its manager. `release()` releases the region explicitly and closes the manager;
    its pages go when the last view does (a view still held then is reported, by the
    log line and `hostpool_released_mapped_bytes`). Idempotent."""

    def __init__(
        self,
        pool: str,
        num_chunks: int,
        row_bytes: int,
        options: Mapping[str, Any],
        budget: int | None,
    ) -> None:
        self.pool = pool
        self.num_chunks = num_chunks
        self.row_bytes = row_bytes
        self.manager = HostPoolManager(budget=budget)
        try:
            self.allocator = self.manager.allocator(pool, "shm", **options)
            self.tensor: torch.Tensor | None = self.allocator.allocate(
                (num_chunks, row_bytes), torch.int8
            )
        except BaseException:
            self.manager.close()
            raise
        self.nbytes = num_chunks * row_bytes
        self._released = False

    @property
    def base(self) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError(f"hostpool offload region of pool {self.pool!r} is released")
        return self.tensor

    def release(self) -> None:
        """Release the region explicitly and log the pool's release counts (vLLM's log)."""
        if self._released:
            return
        self._released = True
        tensor, self.tensor = self.tensor, None
        if tensor is not None:
            # Release while we still hold the tensor: an explicit release, whose pages
            # go with the last view. Dropping the tensor first would let its finalizer
            # count the release as `finalizer` (the leak signal).
            self.allocator.release(tensor)
            del tensor
        report = self.manager.close()
        metrics_route.worker_region_released()
        counts = {
            how: n
            for (pool, how), n in get_ledger().counters()["releases_total"].items()
            if pool == self.pool
        }
        logger.info(
            "hostpool: released offload pool %s (%d bytes) explicitly; pool releases %s%s",
            self.pool,
            self.nbytes,
            " ".join(f"{how}={n}" for how, n in sorted(counts.items())) or "none",
            f"; still mapped by views: {report}" if report else "",
        )


class HostCopyWorker(OffloadingWorker):
    """Copies KV blocks between the engine's KV cache and a `HostpoolRegion` with torch
    index ops, synchronously (platforms without vLLM's copy kernels, e.g. CPU).

    The CPU layout is vLLM's worker-private one: per chunk row, each KV tensor's
    `page_size * blocks_per_chunk` bytes back to back."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: HostpoolRegion,
        on_shutdown: Callable[[], None],
    ) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.region = region
        self._on_shutdown = on_shutdown
        self._refs = kv_caches.group_data_refs
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        offset = 0
        base = region.base
        for kv in kv_caches.tensors:
            page = kv.page_size_bytes
            self._device.append(kv.tensor.view(torch.int8).view((-1, page)))
            width = page * blocks_per_chunk
            # (chunks, blocks_per_chunk, page): a strided view of the region's rows.
            self._host.append(base[:, offset : offset + width].view(-1, blocks_per_chunk, page))
            offset += width
        if offset > region.row_bytes:
            raise ValueError(
                f"KV tensors need {offset} bytes per chunk, region rows hold {region.row_bytes}"
            )
        self._finished: list[TransferResult] = []

    def _copy(self, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec, to_host: bool) -> int:
        assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)
        bpc = self.blocks_per_chunk
        device_ids = gpu_spec.block_ids
        chunk_ids = cpu_spec.block_ids
        device_at = host_at = 0
        nbytes = 0
        for g_idx, (size, block_idx) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = block_idx % bpc
            n_chunks = -(-(size + skip) // bpc)
            chunks = chunk_ids[host_at : host_at + n_chunks].astype(np.int64)
            host_at += n_chunks
            blocks = torch.from_numpy(device_ids[device_at : device_at + size].astype(np.int64))
            device_at += size
            # Sub-blocks of the chunks in order, minus the first `skip` (a partial chunk).
            flat = (chunks[:, None] * bpc + np.arange(bpc)).ravel()[skip : skip + size]
            rows = torch.from_numpy(flat // bpc)
            subs = torch.from_numpy(flat % bpc)
            for ref in self._refs[g_idx]:
                page = ref.page_size_bytes
                device = self._device[ref.tensor_idx]
                host = self._host[ref.tensor_idx]
                if to_host:
                    host[rows, subs, :page] = device[blocks, :page]
                else:
                    device[blocks, :page] = host[rows, subs, :page]
                nbytes += size * page
        if device_at != len(device_ids) or host_at != len(chunk_ids):
            raise ValueError(
                f"transfer spans {device_at}/{len(device_ids)} device blocks and "
                f"{host_at}/{len(chunk_ids)} host chunks"
            )
        return nbytes

    def _run(self, job_id: int, gpu_spec: Any, cpu_spec: LoadStoreSpec, to_host: bool) -> bool:
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        started = time.perf_counter()
        try:
            nbytes = self._copy(gpu_spec, cpu_spec, to_host)
        except Exception:
            logger.exception(
                "hostpool offload %s job %d failed", "store" if to_host else "load", job_id
            )
            self._finished.append(TransferResult(job_id=job_id, success=False))
            return True
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=nbytes,
                transfer_time=time.perf_counter() - started,
            )
        )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._run(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._run(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer completed in submit

    def shutdown(self) -> None:
        self._device.clear()
        self._host.clear()
        self._on_shutdown()


class HostpoolSharedRegion(SharedOffloadRegion):
    """A `HostpoolRegion` in the shape vLLM 0.32's `CPUOffloadingWorker` expects of its
    `SharedOffloadRegion` (rank 0 slot of a worker-private region): vLLM's worker makes
    its views, pins and unpins it; `cleanup()` (called by that worker's `shutdown()`)
    does vLLM's part, then releases the hostpool region explicitly.

    It does not call `SharedOffloadRegion.__init__` (which creates a `/dev/shm` file); it
    sets the attributes vLLM 0.32's worker and `pin_mmap_region` read."""

    def __init__(self, region: HostpoolRegion, cpu_page_size: int) -> None:
        self.hostpool_region = region
        self.page_size = mmap.PAGESIZE
        self.num_chunks = region.num_chunks
        self._row_stride = region.row_bytes
        self.total_size_bytes = region.nbytes
        self.mmap_path = ""
        self._creator = False
        self.rank = 0
        self._worker_offset = 0
        self._worker_area_end = cpu_page_size
        self.fd = None
        self.mmap_obj = None
        self._base = region.base.view(-1)
        self._views: list[torch.Tensor] = []
        self._canonical_offset = 0
        self.is_pinned = False
        self.pinned_addresses: list[int] = []

    def cleanup(self) -> None:
        super().cleanup()
        self.hostpool_region.release()


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
        super().__init__(config)
        self.region: HostpoolRegion | None = None  # this worker's, once get_worker ran
        self._hostpool_worker: OffloadingWorker | None = None

    def _uses_shared_region(self) -> bool:
        # Each rank has its own hostpool region: no cross-rank shared file, no replicated
        # (single-copy) layout.
        return False

    def _uses_vllm_worker(self) -> bool:
        """Whether vLLM's own copy worker runs on this platform (the stock spec's test)."""
        return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._hostpool_worker is not None:
            return self._hostpool_worker
        per_chunk = sum(t.page_size_bytes for t in kv_caches.tensors) * self.blocks_per_chunk
        page = mmap.PAGESIZE
        row_bytes = -(-max(per_chunk, self.cpu_page_size_per_worker, 1) // page) * page
        num_chunks = max(self.num_chunks, 1)
        region = HostpoolRegion(
            self.pool, num_chunks, row_bytes, self.allocator_options, self.budget
        )
        self.region = region
        try:
            worker: OffloadingWorker
            if self._uses_vllm_worker():
                shared = HostpoolSharedRegion(region, cpu_page_size=row_bytes)
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
            self.pool,
            num_chunks,
            row_bytes,
            region.nbytes,
            "vLLM's CPUOffloadingWorker" if self._uses_vllm_worker() else "HostCopyWorker",
        )
        self._hostpool_worker = worker
        return worker
