"""Run in .venv-vllm by test_spec_offline.py: two `vllm.LLM` engines in this one process,
each with `HostpoolOffloadingSpec` and its own pool, then both shut down through vLLM.

argv: model_dir, result_json. Prints vLLM's (and its workers') log on stdout/stderr; writes
what it saw to result_json: per engine the pool, the worker pid, the worker's memfd sizes
while the engine ran, the tokens before and after a prefix-cache reset.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import psutil
from vllm import LLM, SamplingParams

BLOCK_SIZE = 32
PROMPT = list(range(3, 200))


def memfds(pid: int, pool: str) -> list[int]:
    sizes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:hostpool.{pool}."):
            sizes.append(os.stat(f"/proc/{pid}/fd/{fd}").st_size)
    return sizes


def workers() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "Worker" in " ".join(p.cmdline())
    }


def engine(model: str, pool: str) -> LLM:
    return LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_module_path": "hostpool.integrations.vllm",
                "spec_name": "HostpoolOffloadingSpec",
                "cpu_bytes_to_use": 32 << 20,
                "block_size": BLOCK_SIZE,
                "hostpool_pool": pool,
            },
        },
    )


def tokens(llm: LLM) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def main() -> None:
    model, result_path = sys.argv[1], sys.argv[2]
    result: dict[str, Any] = {"engines": []}
    llms = []
    seen: set[int] = set()
    for pool in ("vllm_offload_a", "vllm_offload_b"):
        llm = engine(model, pool)
        (worker,) = workers() - seen
        seen.add(worker)
        first = tokens(llm)
        llm.reset_prefix_cache()
        again = tokens(llm)
        result["engines"].append(
            {
                "pool": pool,
                "worker": worker,
                "memfds": memfds(worker, pool),
                "first": first,
                "again": again,
            }
        )
        llms.append(llm)
    # Both engines alive at once: each worker holds its own pool only.
    for entry in result["engines"]:
        entry["memfds_both_alive"] = memfds(entry["worker"], entry["pool"])
        other = "vllm_offload_b" if entry["pool"] == "vllm_offload_a" else "vllm_offload_a"
        entry["other_pool_memfds"] = memfds(entry["worker"], other)
    for llm in llms:
        # vLLM's own shutdown of the engine: EngineCore, its executor, the worker.
        llm.llm_engine.engine_core.shutdown(timeout=120)
    result["workers_left"] = sorted(workers())
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
