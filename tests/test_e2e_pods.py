"""End to end, the node view per pod: a real Prometheus scrapes `hostpool exporter --node`
and a stand-in for kube-state-metrics (one `kube_pod_info` series, served here) with the
shipped rules; a pod's processes (in a cgroup named as kubelet's systemd driver names
it) hold an LMCache memfd, and left a vLLM and an `unknown` orphan in their own /dev/shm.
The recording rule names the pod, the dashboard's per-pod panels show it, and
HostpoolOrphanedShm goes pending for vllm and never for `unknown`. Root only."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import dashboard_lint, exporting, helpers, waiting
from tests.helpers import prometheus_api
from tests.kubeview import cgroup_root, pod_cgroup, serving

ROOT = Path(__file__).resolve().parents[1]
RULE = "instance_pod_engine_area_state:hostpool_host_shm_bytes:sum"
pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed"),
    pytest.mark.skipif(
        os.geteuid() != 0 or cgroup_root() is None or shutil.which("unshare") is None,
        reason="needs root, a cgroup hierarchy and unshare",
    ),
]

# The pod's engines: an LMCache memfd (64 KiB written) and, in its own /dev/shm, the
# offload file a crashed run left and a file no engine's name says whose it is.
POD = """
set -e
mount -t tmpfs -o size=4m tmpfs /dev/shm
head -c 131072 /dev/urandom > "/dev/shm/vllm_offload_$1.mmap"
head -c 65536 /dev/urandom > "/dev/shm/notes_$1"
exec python3 -c '
import os, sys
fd = os.memfd_create("lmcache_" + sys.argv[1])
os.write(fd, os.urandom(65536))
print("ready", flush=True)
sys.stdin.read()
' "$1"
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(Prometheus' base URL, the pod's uid), once the rule has named the pod."""
    tmp = tmp_path_factory.mktemp("pods")
    uid, token = str(uuid.uuid4()), secrets.token_hex(6)
    info = (
        f'kube_pod_info{{namespace="ml",pod="vllm-0",uid="{uid}",node="n1"}} 1\n'
        f'kube_pod_info{{namespace="web",pod="nginx-1",uid="{uuid.uuid4()}",node="n2"}} 1\n'
    )
    with (
        serving(info) as ksm,
        pod_cgroup(uid, "ef" * 32) as into_pod,
        subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", POD, "sh", token],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        ) as pod,
    ):  # fmt: skip
        assert pod.stdin is not None and pod.stdout is not None
        exporter = exporting.start_exporter("--node")
        try:
            into_pod(pod.pid)  # unshare execs sh, then python: the same process
            assert pod.stdout.readline() == "ready\n"
            for name in ("alerts.yml", "recording.yml"):
                shutil.copy(ROOT / "metrics" / name, tmp / name)
            target = exporter.url.removeprefix("http://").removesuffix("/metrics")
            config = tmp / "prometheus.yml"
            config.write_text(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "rule_files: [alerts.yml, recording.yml]\n"
                "scrape_configs:\n"
                f"  - job_name: hostpool-node\n    static_configs: [{{targets: ['{target}']}}]\n"
                "  - job_name: kube-state-metrics\n    honor_labels: true\n"
                f"    static_configs: [{{targets: ['{ksm}']}}]\n"
            )
            with helpers.prometheus(config, tmp) as (prom, base):

                def named() -> bool:
                    try:
                        query = f'{RULE}{{pod_uid="{uid}", namespace="ml", state="orphaned"}}'
                        return bool(prometheus_api(base, "query", query=query)["result"])
                    except (OSError, AssertionError):
                        return False  # not listening yet

                waiting.wait_for(named, "the rule naming the pod", alive=prom, interval=0.5)
                yield base, uid
        finally:
            pod.stdin.close()
            exporter.stop()


def _series(base: str, query: str) -> list[dict[str, str]]:
    return [
        {**r["metric"], "value": r["value"][1]}
        for r in prometheus_api(base, "query", query=query)["result"]
    ]


def test_the_rule_names_the_pod_of_every_object(node: tuple[str, str]) -> None:
    base, uid = node
    got = {
        (s.get("engine"), s.get("area", ""), s.get("state")): s
        for s in _series(base, f'{RULE}{{pod_uid="{uid}"}}')
    }
    for series in got.values():
        assert (series["namespace"], series["pod"], series["job"]) == ("ml", "vllm-0",
                                                                       "hostpool-node")  # fmt: skip
    assert float(got[("lmcache", "", "held")]["value"]) >= 65536  # the memfd
    assert float(got[("vllm", "dev_shm", "orphaned")]["value"]) >= 131072
    assert float(got[("unknown", "dev_shm", "orphaned")]["value"]) >= 65536
    # what is no pod's keeps its series, unnamed
    for series in _series(base, f'{RULE}{{pod_uid=""}}'):
        assert "namespace" not in series and "pod" not in series


def test_the_per_pod_panels_show_the_pod(node: tuple[str, str]) -> None:
    base, uid = node
    queries = dict(dashboard_lint.panel_queries(dashboard_lint.load_dashboard()))
    top = _series(base, queries["Top pods by shared memory"])
    assert any((s.get("pod"), s.get("pod_uid")) == ("vllm-0", uid) for s in top), top
    orphans = _series(base, queries["Orphans by pod"])
    mine = {(s.get("engine"), s.get("area")) for s in orphans if s.get("pod") == "vllm-0"}
    assert mine == {("vllm", "dev_shm"), ("unknown", "dev_shm")}


def test_orphaned_shm_pends_for_known_engines_only(node: tuple[str, str]) -> None:
    """HostpoolOrphanedShm (10 minutes) is pending for the pod's vllm orphan, never for
    its `unknown` one."""
    base, _uid = node

    def pending() -> set[str] | None:
        alerts = prometheus_api(base, "alerts")["alerts"]
        engines = {a["labels"]["engine"] for a in alerts
                   if a["labels"]["alertname"] == "HostpoolOrphanedShm"}  # fmt: skip
        return engines if "vllm" in engines else None

    engines = waiting.wait_for(pending, "HostpoolOrphanedShm pending for vllm", interval=0.5)
    assert "unknown" not in engines
