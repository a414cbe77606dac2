"""`HostpoolOffloadingSpec` built by vLLM's own factory in the real vLLM package, without a
server: the CPU copy worker's placement and round trip, the CUDA/XPU hand-off to vLLM's own
`CPUOffloadingWorker` (with only CUDA's copy engine and host registration faked), and bad
options refused with typed errors and nothing left behind."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.vllm.server import REPO, base_env, vllm_python

CHILD = Path(__file__).with_name("spec_worker_child.py")


def run(scenario: str) -> dict[str, Any]:
    proc = subprocess.run(
        [str(vllm_python()), str(CHILD), scenario],
        env=base_env(),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[0].removeprefix("RESULT "))
    result["stderr"] = proc.stderr
    return result


def test_cpu_copy_worker_places_blocks_as_vllm_addresses_them_and_loads_them_back() -> None:
    r = run("copy_round_trip")
    page_bytes = 4096 + 2048
    assert r["stored"] == [[1, True, 5 * page_bytes]]
    assert r["loaded"] == [[2, True, 5 * page_bytes]]
    assert r["placed"] and r["restored"]
    # 2 blocks per chunk, rows of 2 * (4096 + 2048) bytes, page aligned, in 1 MiB.
    assert r["num_chunks"] == (1 << 20) // 12288
    assert r["region_bytes"] == r["num_chunks"] * 12288
    assert r["during"] == {"memfds": 2, "mappings": 1}  # hostpool's fd + mmap's dup
    assert r["after"] == {"memfds": 0, "mappings": 0}
    assert r["releases"] == {"explicit": 1}
    assert "hostpool.leak" not in r["stderr"]


def test_cuda_path_hands_the_region_to_vllms_own_worker() -> None:
    r = run("vllm_worker_seam")
    assert r["worker"] == "CPUOffloadingWorker"
    # vLLM pinned hostpool's region itself (pinning stays vLLM's), whole, and unpinned it
    # at cleanup before hostpool released it.
    assert r["registered"] == [[r["base_ptr"], r["region_bytes"]]]
    assert r["unregistered"] == [r["base_ptr"]]
    assert r["views_in_region"]
    chunks = r["region_bytes"] // r["row_bytes"]
    assert r["shapes"] == [[chunks, 4096], [chunks, 2048]]
    assert r["strides"] == [[r["row_bytes"], 1], [r["row_bytes"], 1]]
    assert r["releases"] == {"explicit": 1}
    assert r["after"] == {"memfds": 0, "mappings": 0}


def test_an_untested_vllm_on_a_device_gets_hostpools_own_copy_worker() -> None:
    """Outside the versions `internals` was read from, vLLM's worker is not handed a
    region whose private state hostpool would have to guess: one warning, HostCopyWorker."""
    r = run("untested_vllm_on_a_device")
    assert r["worker"] == "HostCopyWorker"
    [warned] = r["warnings"]
    assert (warned["package"], warned["installed"]) == ("vllm", "0.99.0")
    assert r["releases"] == {"explicit": 1}
    assert r["after"] == {"memfds": 0, "mappings": 0}


def test_bad_options_are_typed_errors_and_leave_nothing() -> None:
    r = run("refusals")
    assert r["unknown_key"][0] == "ConfigError" and "hostpool_hugepages" in r["unknown_key"][2]
    assert r["bad_pool"][0] == "InvalidRequestError"
    assert r["bad_hugepages"][0] == "InvalidRequestError"
    assert r["required_1g"][:2] == ["HugepageUnavailableError", "hugepages"]
    assert r["over_budget"][:2] == ["AllocationError", "budget"]
    assert r["fds_same"] and r["mappings"] == 0 and r["memfds"] == 0
    assert r["ledger"] == []


def test_a_squatted_metrics_directory_leaves_vllm_running() -> None:
    """Issue 36, point 2: another uid's metrics directory turns hostpool's series off with
    one warning per side (API server, worker); get_worker and vLLM's /metrics go on."""
    r = run("squatted_metrics_dir")
    assert r["worker"] == "HostCopyWorker" and r["stored"]
    assert r["exposition_lines"] > 0 and r["hostpool_series"] == []
    assert r["written"] == []
    assert r["stderr"].count("hostpool.vllm_metrics_disabled") == 2, r["stderr"][-3000:]
    assert "uid 65534" in r["stderr"]
