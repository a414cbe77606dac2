"""The offload memory `HostpoolOffloadingSpec` gives vLLM: one worker's hostpool region
(`HostpoolRegion`) or a lease of the broker's pool (`BrokerRegion`), and the worker that
copies KV blocks into it with torch index ops where vLLM's own worker cannot run
(`HostCopyWorker`, e.g. on a CPU platform)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from hostpool.core.ledger import get_ledger
from hostpool.core.manager import PoolManager
from hostpool.integrations.vllm import metrics_route
from hostpool.memory.options import RegionOptions

# Under vLLM's logger tree, so the lines appear in the server's log as vLLM's own do.
logger = init_logger(f"vllm.{__name__}")


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
        options: RegionOptions,
        budget: int | None,
    ) -> None:
        self.pool = pool
        self.num_chunks = num_chunks
        self.row_bytes = row_bytes
        self.manager = PoolManager(budget=budget)
        try:
            self.allocator = self.manager.allocator(pool, "shm", region_options=options)
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
            for (pool, how), n in get_ledger().counters().releases_total.items()
            if pool == self.pool
        }
        logger.info(
            "hostpool: released offload pool %s (%d bytes) explicitly; pool releases %s%s",
            self.pool,
            self.nbytes,
            " ".join(f"{how}={n}" for how, n in sorted(counts.items())) or "none",
            f"; still mapped by views: {report}" if report else "",
        )


class BrokerRegion:
    """One worker's offload memory leased from the broker (`hostpool serve`): the pool's
    memory mapped side by side, viewed as `num_chunks` rows of `row_bytes`. The broker
    owns the memory: `release()` drops the view and ends the lease (the memory and what
    was stored stay with the broker for the next engine). Idempotent."""

    def __init__(self, broker: str, pool: str, num_chunks: int, row_bytes: int) -> None:
        from hostpool.broker.client import lease

        self.pool = pool
        self.num_chunks = num_chunks
        self.row_bytes = row_bytes
        self.nbytes = num_chunks * row_bytes
        self.lease = lease(broker, pool)
        if self.lease.size < self.nbytes:
            size = self.lease.size
            self.lease.close()
            raise ValueError(
                f"broker pool {pool!r} holds {size} bytes; this worker needs {self.nbytes} "
                f"({num_chunks} chunks x {row_bytes} bytes, from cpu_bytes_to_use): give the "
                "pool at least that size (`hostpool serve --pool NAME=SIZE`) or lower "
                "cpu_bytes_to_use"
            )
        # The mapping goes with the last view, not at release: a view vLLM still holds
        # then stays valid (the pages are the broker's either way).
        mapped = self.lease.hand_over().array(0, self.nbytes)
        flat = torch.frombuffer(mapped, dtype=torch.int8, count=self.nbytes)
        self.tensor: torch.Tensor | None = flat.view(num_chunks, row_bytes)

    @property
    def base(self) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError(f"the lease of broker pool {self.pool!r} has ended")
        return self.tensor

    def release(self) -> None:
        """End the lease (the broker keeps the memory); the mapping goes with the last
        view of it."""
        if self.tensor is None:
            return
        self.tensor = None
        self.lease.close()
        logger.info(
            "hostpool: ended the lease of broker pool %s (%d bytes); the broker keeps it",
            self.pool,
            self.nbytes,
        )


OffloadMemory = HostpoolRegion | BrokerRegion


class HostCopyWorker(OffloadingWorker):
    """Copies KV blocks between the engine's KV cache and a `HostpoolRegion` with torch
    index ops, synchronously (platforms without vLLM's copy kernels, e.g. CPU).

    The CPU layout is vLLM's worker-private one: per chunk row, each KV tensor's
    `page_size * blocks_per_chunk` bytes back to back."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: OffloadMemory,
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
