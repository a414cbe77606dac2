"""`HostpoolOffloadingSpec` in vLLM's offline engine (`vllm.LLM`): two engines in one
process, two pools, each loaded back after a prefix-cache reset, both released explicitly
when vLLM shuts the engines down."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.vllm.server import REPO, base_env, vllm_python, write_tiny_model

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("spec_offline_child.py")
REGION = re.compile(
    r"\(Worker pid=(?P<pid>\d+)\).*hostpool: offload pool (?P<pool>\S+): \d+ chunks x \d+ "
    r"bytes \((?P<bytes>\d+) bytes\)"
)
RELEASED = re.compile(
    r"\(Worker pid=(?P<pid>\d+)\).*hostpool: released offload pool (?P<pool>\S+) "
    r"\((?P<bytes>\d+) bytes\) explicitly; pool releases (?P<counts>[^;\n]*)"
)


def test_two_offline_engines_two_pools_both_released(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model")
    result_path = tmp_path / "result.json"
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith(("vllm_", "hostpool."))}
    proc = subprocess.run(
        [str(vllm_python()), str(CHILD), str(model), str(result_path)],
        env=base_env(),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    result = json.loads(result_path.read_text())

    made = {m["pool"]: (int(m["pid"]), int(m["bytes"])) for m in REGION.finditer(log)}
    assert set(made) == {"vllm_offload_a", "vllm_offload_b"}, log[-4000:]
    for engine in result["engines"]:
        pid, size = made[engine["pool"]]
        assert pid == engine["worker"]
        assert engine["first"] and engine["again"] == engine["first"]
        # hostpool's fd and mmap's dup of it, both the region's size; the other engine's
        # pool is not in this worker.
        assert engine["memfds"] == [size, size]
        assert engine["memfds_both_alive"] == [size, size]
        assert engine["other_pool_memfds"] == []
    assert made["vllm_offload_a"][0] != made["vllm_offload_b"][0]

    released = {m["pool"]: m for m in RELEASED.finditer(log)}
    assert set(released) == {"vllm_offload_a", "vllm_offload_b"}, log[-4000:]
    for pool, match in released.items():
        assert int(match["pid"]) == made[pool][0]
        assert int(match["bytes"]) == made[pool][1]
        assert match["counts"].split() == ["explicit=1"], match["counts"]
    assert "finalizer" not in log
    assert result["workers_left"] == []
    for engine in result["engines"]:
        assert not os.path.exists(f"/proc/{engine['worker']}")
    after = {n for n in os.listdir("/dev/shm") if n.startswith(("vllm_", "hostpool."))}
    assert after == shm_before
