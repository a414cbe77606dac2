"""Run in .venv-vllm by test_broker_manager.py: `python broker_manager_child.py SOCK PHASE`.

`HostpoolOffloadingSpec` with `hostpool_broker`, built through vLLM's own factory, its
scheduler-side manager and its worker driven through vLLM's interfaces against a real
broker (`hostpool serve`). Prints one `RESULT <json>` line.

- `store`: stores keys A, B, C (real KV bytes copied into the broker's pool), completes A
  and B only (C's store was started, never completed: the fault), then dies by SIGKILL;
- `adopt`: a new engine: looks A..C up, loads A and B back into wiped KV caches;
- `other`: an engine whose model differs: looks A up;
- `small`: a worker whose broker pool is smaller than it needs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tests.vllm.spec_worker_child import kv_caches, offloading_config


def key(n: int) -> OffloadKey:
    return OffloadKey(bytes([n]) * 32 + (0).to_bytes(4, "big"))


def main(sock: str, phase: str) -> dict[str, Any]:
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))  # as EngineCore does
    config = offloading_config({"hostpool_broker": sock, "hostpool_pool": "kv"}, 1)
    if phase == "other":
        config = config.__class__(**{**config.__dict__, "model": config.model.__class__(
            name="another", dtype="float32")})  # fmt: skip
    if phase == "small":  # the broker's pool `tiny` is smaller than the worker needs
        config = offloading_config({"hostpool_broker": sock, "hostpool_pool": "tiny"}, 1)
        try:
            OffloadingSpecFactory.create_spec(config).get_worker(kv_caches())
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": None}
    spec = OffloadingSpecFactory.create_spec(config)
    manager = spec.get_manager()
    kv = kv_caches()
    original = [t.tensor.clone() for t in kv.tensors]
    worker = spec.get_worker(kv)
    ctx = ReqContext(req_id="r")
    keys = [key(1), key(2), key(3)]
    if phase == "store":
        out = manager.prepare_store(keys, ctx)
        chunks = [int(c) for c in out.store_spec.block_ids]
        blocks = [4, 9, 17]
        gpu = GPULoadStoreSpec(blocks, group_sizes=[3], block_indices=[0])
        assert worker.submit_store(1, gpu, out.store_spec)
        assert [r.success for r in worker.get_finished()] == [True]
        manager.complete_store(keys[:2], ctx)  # C: started, never completed
        print("RESULT " + json.dumps({"chunks": chunks, "blocks": blocks}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    found = [manager.lookup(k, ctx).name for k in keys]
    result: dict[str, Any] = {"lookup": found}
    if phase == "adopt" and found[:2] == [LookupResult.HIT.name] * 2:
        load = manager.prepare_load(keys[:2], ctx)
        result["chunks"] = [int(c) for c in load.block_ids]
        blocks = [4, 9]
        for t in kv.tensors:
            t.tensor[blocks] = 0
        gpu = GPULoadStoreSpec(blocks, group_sizes=[2], block_indices=[0])
        assert worker.submit_load(2, load, gpu)
        assert [r.success for r in worker.get_finished()] == [True]
        result["restored"] = all(
            torch.equal(t.tensor[blocks], o[blocks])
            for t, o in zip(kv.tensors, original, strict=True)
        )
        manager.complete_load(keys[:2], ctx)
    worker.shutdown()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
