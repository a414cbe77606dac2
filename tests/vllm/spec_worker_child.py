"""Run in .venv-vllm by test_spec_worker.py: `python spec_worker_child.py SCENARIO`.

Each scenario builds `HostpoolOffloadingSpec` through vLLM's own factory (the path vLLM's
connector takes) with real KV-cache tensors, and prints one `RESULT <json>` line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from vllm.v1.kv_offload import config as c
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from hostpool.core.ledger import get_ledger

PAGES = (4096, 2048)  # two KV tensors with different page sizes
NUM_BLOCKS = 24


def offloading_config(extra: dict[str, Any], blocks_per_chunk: int) -> Any:
    return c.OffloadingConfig(
        groups=(
            c.OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),
        ),
        worker_kv_bytes_per_block=sum(PAGES),
        enable_kv_cache_events=False,
        extra_config={
            "spec_module_path": "hostpool.integrations.vllm",
            "spec_name": "HostpoolOffloadingSpec",
            "cpu_bytes_to_use": 1 << 20,
            **extra,
        },
        engine_id=f"hostpool-test-{os.getpid()}",
        model=c.OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk),
        parallel=c.OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def kv_caches() -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(7)
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.randint(-128, 127, (NUM_BLOCKS, page), dtype=torch.int8, generator=gen),
            page_size_bytes=page,
        )
        for page in PAGES
    ]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=p) for i, p in enumerate(PAGES)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def memfds(pool: str) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:hostpool.{pool}."):
                n += 1
        except OSError:
            pass
    return n


def mappings(pool: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(f"hostpool.{pool}." in line for line in f)


def releases(pool: str) -> dict[str, int]:
    return {how: n for (p, how), n in get_ledger().counters().releases_total.items() if p == pool}


def placed_as_vllm_addresses(
    host: torch.Tensor,
    original: list[torch.Tensor],
    blocks: list[int],
    chunks: list[int],
    bpc: int,
    skip: int,
) -> bool:
    """Each stored block sits where vLLM's own addressing puts it (`compute_sub_block_ptrs`:
    row `chunk`, slot j at `j * page` within the tensor's area; the first chunk's first
    `skip % bpc` slots skipped). Views made here die with this frame: a view held past
    shutdown would keep the pages (and the release would say so)."""
    slots = [(c, j) for c in chunks for j in range(bpc)][skip % bpc :][: len(blocks)]
    for t_idx, page in enumerate(PAGES):
        offset = sum(PAGES[:t_idx]) * bpc
        for block, (row, slot) in zip(blocks, slots, strict=True):
            got = host[row, offset + slot * page : offset + (slot + 1) * page]
            if not torch.equal(got, original[t_idx][block]):
                return False
    return True


def copy_round_trip() -> dict[str, Any]:
    """Store GPU blocks 5..9 (a partial first chunk: block index 3 of the request, 2 blocks
    per chunk) into chunks [4, 7, 2], wipe them, load them back."""
    bpc = 2
    spec = OffloadingSpecFactory.create_spec(offloading_config({"hostpool_pool": "copy"}, bpc))
    kv = kv_caches()
    worker = spec.get_worker(kv)
    original = [t.tensor.clone() for t in kv.tensors]
    blocks = [5, 6, 7, 8, 9]
    chunks = [4, 7, 2]
    gpu = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[3])
    cpu = CPULoadStoreSpec(chunks)
    assert worker.submit_store(1, gpu, cpu)
    stored = worker.get_finished()
    placed = placed_as_vllm_addresses(spec.region.base, original, blocks, chunks, bpc, skip=3)
    for t in kv.tensors:
        t.tensor[blocks] = 0
    assert worker.submit_load(2, cpu, gpu)
    loaded = worker.get_finished()
    restored = all(torch.equal(t.tensor, o) for t, o in zip(kv.tensors, original, strict=True))
    during = {"memfds": memfds("copy"), "mappings": mappings("copy")}
    region_bytes = spec.region.nbytes
    worker.shutdown()
    return {
        "stored": [(r.job_id, r.success, r.transfer_size) for r in stored],
        "loaded": [(r.job_id, r.success, r.transfer_size) for r in loaded],
        "placed": placed,
        "restored": restored,
        "during": during,
        "after": {"memfds": memfds("copy"), "mappings": mappings("copy")},
        "releases": releases("copy"),
        "region_bytes": region_bytes,
        "num_chunks": spec.num_chunks,
    }


def vllm_worker_seam() -> dict[str, Any]:
    """The CUDA/XPU path on this CPU host: vLLM's own CPUOffloadingWorker gets the hostpool
    region; what cannot run here is faked at vLLM's seams only (the CUDA copy handler and
    cudaHostRegister), so vLLM's own code pins, views and cleans up hostpool's memory."""
    from vllm.v1.kv_offload.cpu import gpu_worker, shared_offload_region

    from hostpool.integrations.vllm import spec as spec_module

    registered: list[tuple[int, int]] = []
    unregistered: list[int] = []
    handlers: list[dict[str, Any]] = []

    class FakeCudaHandler:
        def __init__(self, **kwargs: Any) -> None:
            handlers.append(kwargs)

        def shutdown(self) -> None:
            return

    gpu_worker.SingleDirectionOffloadingHandler = FakeCudaHandler
    gpu_worker.PIN_MEMORY = True
    gpu_worker.host_register = lambda address, size: registered.append((address, size)) or True
    shared_offload_region.host_unregister = unregistered.append
    spec_module.HostpoolOffloadingSpec._uses_vllm_worker = lambda self: True

    spec = OffloadingSpecFactory.create_spec(offloading_config({"hostpool_pool": "seam"}, 1))
    kv = kv_caches()
    worker = spec.get_worker(kv)
    region = spec.region
    base = region.base
    cpu_tensors = handlers[0]["cpu_tensors"]
    views_in_region = all(
        base.data_ptr() <= t.data_ptr() < base.data_ptr() + region.nbytes for t in cpu_tensors
    )
    shapes = [list(t.shape) for t in cpu_tensors]
    strides = [list(t.stride()) for t in cpu_tensors]
    base_ptr = base.data_ptr()
    del base, cpu_tensors
    handlers.clear()
    worker_type = type(worker).__name__
    worker.shutdown()
    return {
        "worker": worker_type,
        "registered": registered,
        "unregistered": unregistered,
        "base_ptr": base_ptr,
        "region_bytes": region.nbytes,
        "row_bytes": region.row_bytes,
        "views_in_region": views_in_region,
        "shapes": shapes,
        "strides": strides,
        "releases": releases("seam"),
        "after": {"memfds": memfds("seam"), "mappings": mappings("seam")},
    }


def refusals() -> dict[str, Any]:
    """Bad options: a typed error at once, nothing left behind."""
    from hostpool import errors

    out: dict[str, Any] = {}
    cases = {
        "unknown_key": {"hostpool_hugepage": "prefer"},
        "bad_pool": {"hostpool_pool": "bad name!"},
        "bad_hugepages": {"hostpool_hugepages": "sometimes"},
        "required_1g": {"hostpool_hugepages": "required", "hostpool_hugepage_size": "1GB"},
        "over_budget": {"hostpool_budget": 4096},
    }
    fds_before = sorted(os.listdir("/proc/self/fd"))
    for name, extra in cases.items():
        try:
            spec = OffloadingSpecFactory.create_spec(offloading_config(extra, 1))
            spec.get_worker(kv_caches())
        except errors.HostPoolError as exc:
            out[name] = [type(exc).__name__, getattr(exc, "reason", None), str(exc)]
        else:
            out[name] = None
    out["fds_same"] = sorted(os.listdir("/proc/self/fd")) == fds_before
    out["mappings"] = sum(mappings(p) for p in ("vllm_offload",))
    out["memfds"] = memfds("")
    out["ledger"] = [r.pool for r in get_ledger().snapshot() if r.state == "live"]
    return out


def squatted_metrics_dir() -> dict[str, Any]:
    """The metrics directory belongs to another uid (made first by someone else): the
    route is off with a warning on each side; get_worker, the copies and vLLM's own
    registry's exposition go on."""
    import tempfile

    from prometheus_client import generate_latest
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from hostpool.integrations.vllm import HostpoolOffloadingSpec

    squatted = tempfile.mkdtemp(prefix="hostpool-squatted-metrics-")
    try:
        os.chown(squatted, 65534, 65534)
        extra = {"hostpool_pool": "squat", "hostpool_metrics_dir": squatted}
        HostpoolOffloadingSpec.build_metric_definitions(extra)  # the API server's side
        spec = OffloadingSpecFactory.create_spec(offloading_config(extra, 2))
        kv = kv_caches()
        worker = spec.get_worker(kv)  # the worker's side
        gpu = GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0])
        stored = worker.submit_store(1, gpu, CPULoadStoreSpec([0]))
        exposition = generate_latest(get_prometheus_registry()).decode()
        worker.shutdown()
        return {
            "worker": type(worker).__name__,
            "stored": stored,
            "exposition_lines": len(exposition.splitlines()),
            "hostpool_series": [x for x in exposition.splitlines() if x.startswith("hostpool_")],
            "written": os.listdir(squatted),
        }
    finally:
        os.rmdir(squatted)


def untested_vllm_on_a_device() -> dict[str, Any]:
    """A CUDA-alike platform with a vLLM outside the versions hostpool's internals were
    read from: the spec copies with its own worker instead of filling vLLM's region."""
    import types

    import structlog

    from hostpool.integrations.vllm import internals
    from hostpool.integrations.vllm import spec as spec_module

    spec_module.current_platform = types.SimpleNamespace(  # type: ignore[assignment]
        is_cuda_alike=lambda: True, is_xpu=lambda: False
    )
    internals.installed_version = lambda: "0.99.0"  # type: ignore[assignment]
    with structlog.testing.capture_logs() as logs:
        config = offloading_config({"hostpool_pool": "untested"}, 1)
        spec = OffloadingSpecFactory.create_spec(config)
        worker = spec.get_worker(kv_caches())
        worker.shutdown()
    return {
        "worker": type(worker).__name__,
        "warnings": [e for e in logs if e["event"] == "hostpool.untested_version"],
        "releases": releases("untested"),
        "after": {"memfds": memfds("untested"), "mappings": mappings("untested")},
    }


if __name__ == "__main__":
    scenario = {
        "copy_round_trip": copy_round_trip,
        "vllm_worker_seam": vllm_worker_seam,
        "refusals": refusals,
        "squatted_metrics_dir": squatted_metrics_dir,
        "untested_vllm_on_a_device": untested_vllm_on_a_device,
    }[sys.argv[1]]
    result = scenario()
    print("RESULT " + json.dumps(result, default=str), flush=True)
