"""The exporter DaemonSet's view, simulated (issue [fleet] item 4): the exporter run as
the rendered DaemonSet runs it (its arguments; its capabilities with every other one
dropped from the bounding set; its uid; a read-only root) sees the same objects of
engine-like processes of another uid, each in its own mount namespace with its own tmpfs
/dev/shm, as `hostpool shm --json` run as full root; with either capability dropped it
does not (so the list is the fewest); as a non-root uid, as Kubernetes would run it,
neither (so the DaemonSet runs as uid 0). The node is fresh PID, mount and IPC namespaces
(tests/kubeview.py): /proc shows only what the test planted. Root only.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import helpers, kubeview
from tests.test_kubernetes import KUBE, by_kind, render
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "kubeview.py"

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and uid switching need root"),
    pytest.mark.skipif(
        not all(shutil.which(t) for t in ("unshare", "setpriv", "kubectl")),
        reason="needs unshare, setpriv (util-linux) and kubectl",
    ),
]


def as_the_daemonset(
    container: dict[str, Any],
    pod: dict[str, Any],
    caps: list[str],
    *,
    uid: int | None = None,
    ambient: bool = False,
) -> list[str]:
    """argv running the container's hostpool command as the kubelet would: `caps` the
    only capabilities (bounding set; Kubernetes sets no ambient set, so a non-root uid
    ends with none effective), the pod's uid (or `uid`), a read-only root where the
    container asks for one. `ambient` shows what a non-root uid would need."""
    security = container["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"]
    if uid is None:
        uid = pod["securityContext"]["runAsUser"]
    keep = "-all" + "".join(f",+{c.lower()}" for c in caps)
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            f"--inh-caps={keep}", f"--bounding-set={keep}"]  # fmt: skip
    argv += [f"--ambient-caps={keep}"] if ambient else []
    argv += ["--", sys.executable, "-m", "hostpool", *container["args"]]
    if security["readOnlyRootFilesystem"]:
        ro = 'mount -o bind,remount,ro / && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", ro, "sh", *argv]
    return argv


def test_the_daemonset_sees_what_root_sees_and_needs_both_capabilities() -> None:
    (daemonset,) = by_kind(render(KUBE), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    caps = container["securityContext"]["capabilities"]["add"]
    # the host's processes and the host's SysV segments (this node's IPC namespace)
    assert pod["hostPID"] and pod["hostIPC"]
    # the two the reader reads with; SETUID and SETGID only for the listener's drop to
    # uid 65534 (docs/security.md), dropped by both sides before serving or scanning
    assert sorted(caps) == ["DAC_READ_SEARCH", "SETGID", "SETUID", "SYS_PTRACE"]
    reading = ["SYS_PTRACE", "DAC_READ_SEARCH"]
    assert pod["securityContext"]["runAsNonRoot"] is False
    views = [["root", "cmd", [sys.executable, "-m", "hostpool", "shm", "--json"]]]
    views.append(["daemonset", "scrape", as_the_daemonset(container, pod, caps)])
    for dropped in reading:
        fewer = [c for c in caps if c != dropped]
        views.append([f"without {dropped}", "scrape", as_the_daemonset(container, pod, fewer)])
    # why not runAsNonRoot: the same capabilities reach a non-root uid only as ambient ones
    other = 65533
    views.append(["non-root", "scrape", as_the_daemonset(container, pod, caps, uid=other)])
    views.append(["ambient", "scrape", as_the_daemonset(container, pod, caps, uid=other,
                                                        ambient=True)])  # fmt: skip
    token = secrets.token_hex(6)
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--ipc", "--mount-proc",
         "--propagation", "private", sys.executable, str(DRIVER), "node", token],
        input="".join(json.dumps(v) + "\n" for v in views),
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    root = seen["root"]
    assert "error" not in root, root
    # root sees what was planted: per pod a held file by mapping, one by fd, a memfd, a
    # shared anonymous mapping (held by the pod's engine), the crashed run's orphan in
    # the pod's own /dev/shm, and the node's orphan
    planted = {(kind, engine, orphan) for kind, _, engine, _, orphan, _ in root["planted"]}
    assert planted == {
        ("file", "kvcached", False), ("file", "python", False), ("memfd", "lmcache", False),
        ("anon_shared", "unknown", False), ("file", "vllm", True), ("file", "python", True),
        ("sysv", "unknown", False), ("sysv", "unknown", True),
    }  # fmt: skip
    assert len(root["planted"]) == 13
    holders = {h[0] for *_, hs in root["planted"] for h in hs}
    assert holders == set(seen["pids"])
    assert root["aggregate"] == {
        "kvcached/file/held": [2, 2 << 20],
        "lmcache/memfd/held": [2, 2 << 20],
        "python/file/held": [2, 2 << 20],
        "python/file/orphaned": [1, 1 << 20],
        "unknown/sysv/held": [1, 1 << 20],
        "unknown/sysv/orphaned": [1, 1 << 20],
        "vllm/file/orphaned": [2, 2 << 20],
    }
    # the DaemonSet's exporter, the same
    assert seen["daemonset"] == root["aggregate"]
    for dropped in reading:
        assert seen[f"without {dropped}"] != root["aggregate"], dropped
    assert seen["non-root"] != root["aggregate"]
    assert seen["ambient"] == root["aggregate"]


STARTS_CLEAN = """
set -e
mount -t tmpfs -o size=16m tmpfs /dev/shm
plant() {{ head -c 65536 /dev/zero > "/dev/shm/$1"; }}
plant vllm_offload_crashed.mmap     # a crashed run's offload file
plant notes_of_someone_else         # no engine's name: never reaped by default
{init} > /dev/null                  # the init container
ls /dev/shm
echo --
plant vllm_offload_crashed_again.mmap  # the engine container crashed in place
{engine}
"""


def test_the_vllm_example_starts_clean() -> None:
    """The example's own commands, in a pod-like mount namespace with its own tmpfs
    /dev/shm (and PID namespace, so nothing else on this host is looked at): the init
    container removes the crashed run's offload file, and the engine's `hostpool run
    --reap` the one a crash in place left, before the engine starts."""
    (deployment,) = by_kind(render(KUBE / "examples" / "vllm"), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (engine,) = pod["containers"]
    dash = engine["command"].index("--")
    # the engine itself replaced by a look at /dev/shm as it starts
    run = [*engine["command"][: dash + 1], "ls", "/dev/shm"]
    hostpool = [sys.executable, "-m", "hostpool"]  # the image's `hostpool`
    script = STARTS_CLEAN.format(
        init=shlex.join([*hostpool, *init["command"][1:]]),
        engine=shlex.join([*hostpool, *run[1:]]),
    )
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "private",
         "sh", "-c", script],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    after_init, after_restart = proc.stdout.split("--\n")
    assert after_init.split() == ["notes_of_someone_else"]
    assert after_restart.split() == ["notes_of_someone_else"]


def test_a_kubelet_node_says_which_pod_owns_every_byte(tmp_path: Path) -> None:
    """A node as kubelet lays it out (tests/kubeview.py `kubelet`): two pods' processes in
    cgroups named as the systemd driver names them, each pod's own /dev/shm, token
    volumes, a Memory emptyDir, the node's /run and /dev/shm. `shm --json` gives each
    planted file its area, pod and orphan state; the exporter's per-pod series say the
    same; `reap --yes --all-namespaces` removes exactly the known engines' orphans, and
    leaves the `unknown` ones, the token volumes' and /run's files, and what is held."""
    if kubeview.cgroup_root() is None:
        pytest.skip("no cgroup hierarchy is mounted")
    hostpool = [sys.executable, "-m", "hostpool"]
    exporter = [*hostpool, "exporter", "--node", "--host", "127.0.0.1", "--port", "0"]
    reap = [*hostpool, "reap", "--yes", "--all-namespaces", "--min-age", "0", "--json"]
    views = [
        ["before", "shm", [*hostpool, "shm", "--json"]],
        ["series", "series", exporter],
        ["reaped", "json", reap],
        ["after", "shm", [*hostpool, "shm", "--json"]],
    ]
    token = secrets.token_hex(6)
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--ipc", "--mount-proc",
         "--propagation", "private", sys.executable, str(DRIVER), "kubelet", token,
         str(tmp_path)],
        input="".join(json.dumps(v) + "\n" for v in views),
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    (a, b), (ca, cb) = seen["uids"], seen["containers"]
    for label in ("before", "after", "reaped"):
        assert "error" not in seen[label], seen[label]
    # name -> (area, pod_uid, container_id, orphan, the holders' pods)
    expected = {
        f"psm_{token}_node": ("dev_shm", None, None, True, []),
        f"vllm_offload_{token}_0.mmap": ("dev_shm", a, ca, True, []),
        f"notes_{token}_0": ("dev_shm", a, ca, True, []),
        f"kvcached_{token}_0": ("dev_shm", a, ca, False, [a]),
        f"vllm_offload_{token}_1.mmap": ("dev_shm", b, cb, True, []),
        f"notes_{token}_1": ("dev_shm", b, cb, True, []),
        f"kvcached_{token}_1": ("dev_shm", b, cb, False, [b]),
        f"vllm_offload_{token}_ed.mmap": ("empty_dir", a, None, True, []),
        f"kvcached_{token}_ed": ("empty_dir", a, ca, False, [a]),
        f"psm_{token}_secret0": ("kubelet_volume", a, None, False, []),
        f"token_{token}_0": ("kubelet_volume", a, None, False, []),
        f"tls_{token}_0.key": ("kubelet_volume", a, None, False, []),
        f"psm_{token}_secret1": ("kubelet_volume", b, None, False, []),
        f"token_{token}_1": ("kubelet_volume", b, None, False, []),
        f"tls_{token}_1.key": ("kubelet_volume", b, None, False, []),
        f"vllm_offload_{token}_run.mmap": ("system", None, None, False, []),
    }

    def described(objects: list[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
        return {
            o["name"].rpartition("/")[2]: (o["area"], o["pod_uid"], o["container_id"],
                                          o["orphan"], [h["pod_uid"] for h in o["holders"]])
            for o in objects
        }  # fmt: skip

    assert described(seen["before"]) == expected
    # the exporter's series of the two pods: what shm --json says of their objects
    aggregate: dict[str, list[int]] = {}
    for o in seen["before"]:
        if o["pod_uid"] in (a, b):
            state = "orphaned" if o["orphan"] else "held"
            key = "/".join([o["engine"], o["kind"], state, o["area"] or "", o["pod_uid"]])
            count, size = aggregate.get(key, [0, 0])
            aggregate[key] = [count + 1, size + o["resident_bytes"]]
    assert seen["series"]["pods"] == aggregate
    assert seen["series"]["pods"][f"vllm/file/orphaned/empty_dir/{a}"] == [1, 1 << 20]
    # the known engines' orphans went; nothing else
    reaped = {f"psm_{token}_node", f"vllm_offload_{token}_0.mmap",
              f"vllm_offload_{token}_1.mmap", f"vllm_offload_{token}_ed.mmap"}  # fmt: skip
    assert described(seen["after"]) == {k: v for k, v in expected.items() if k not in reaped}
    assert seen["present"] == [True, True]  # /run's file and a token, read back by path
    if shutil.which("prometheus") is not None:
        alerted_as_exported(seen["series"]["text"], tmp_path)


def alerted_as_exported(text: str, tmp_path: Path) -> None:
    """The shipped alert rules on a real Prometheus, over what the node's exporter
    answered: HostpoolOrphanedShm pending for each known engine with orphans in the
    series (the pods' vllm, the node's python), for none of the `unknown` ones."""
    from prometheus_client.parser import text_string_to_metric_families

    orphaned = {
        s.labels["engine"]
        for family in text_string_to_metric_families(text)
        if family.name in ("hostpool_host_shm_bytes", "hostpool_host_hugetlb_bytes")
        for s in family.samples
        if s.labels["state"] == "orphaned" and s.value > 0
    }
    assert {"vllm", "python", "unknown"} <= orphaned
    shutil.copy(ROOT / "metrics" / "alerts.yml", tmp_path / "alerts.yml")
    config = tmp_path / "prometheus.yml"
    with kubeview.serving(text) as target:
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\nrule_files: [alerts.yml]\n"
            "scrape_configs: [{job_name: hostpool-node, "
            f"static_configs: [{{targets: ['{target}']}}]}}]\n"
        )
        with helpers.prometheus(config, tmp_path) as (prom, base):

            def pending() -> set[str] | None:
                try:
                    alerts = helpers.prometheus_api(base, "alerts")["alerts"]
                except (OSError, AssertionError):
                    return None  # not listening yet
                engines = {a["labels"]["engine"] for a in alerts
                           if a["labels"]["alertname"] == "HostpoolOrphanedShm"}  # fmt: skip
                return engines or None

            engines = wait_for(pending, "HostpoolOrphanedShm pending", alive=prom, interval=0.5)
    assert engines == orphaned - {"unknown"}
