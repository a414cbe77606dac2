"""deploy/kubernetes/, validated offline (issue [fleet]): what `kubectl kustomize` renders
passes `kubernetes-validate --strict` for Kubernetes 1.32 (built-in kinds, a warning is a
failure) and prometheus-operator's own CRD schemas (its kinds: no unknown field, no
missing required one); the PrometheusRule is metrics/*.yml's groups (promtool and the
rule unit tests run on it); every hostpool flag and path the manifests pass exists.

`make test` installs kubectl (`make kubectl`) and promtool (`make prometheus`); the tests
that need them skip only where they are missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from hostpool.cli import build_parser
from tools import kubernetes_rules

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
EXAMPLES = sorted(p for p in (KUBE / "examples").iterdir() if p.is_dir())
CRDS = ROOT / "tests" / "data" / "prometheus-operator"
KUBERNETES_VERSION = "1.32.0"
# What the exporter needs to read other processes' /proc (measured: docs/kubernetes.md),
# and to split itself: the listener's change to uid 65534 (docs/security.md)
CAPABILITIES = ["SYS_PTRACE", "DAC_READ_SEARCH", "SETUID", "SETGID"]

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl not installed: `make kubectl` installs it"
)
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed: `make prometheus`"
)


def render(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize PATH`'s objects."""
    proc = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # a deprecation is a warning: none
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def is_operator_kind(obj: dict[str, Any]) -> bool:
    return str(obj["apiVersion"]).startswith("monitoring.coreos.com/")


@pytest.fixture(scope="module")
def fleet() -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: `make kubectl` installs it")
    return render(KUBE)


@pytest.fixture(scope="module")
def examples() -> dict[str, list[dict[str, Any]]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: `make kubectl` installs it")
    return {path.name: render(path) for path in EXAMPLES}


# ---------------------------------------------------------------- built-in kinds


def kubernetes_validate(objects: list[dict[str, Any]], tmp_path: Path) -> str:
    """kubernetes-validate --strict's output; asserts it passed with no warning."""
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBERNETES_VERSION,
         str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not re.search(r"^(WARN|ERROR)", out, re.M), out
    return out


def test_builtin_kinds_pass_kubernetes_validate_strict(
    fleet: list[dict[str, Any]], examples: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = [o for o in fleet if not is_operator_kind(o)]
    objects += [o for rendered in examples.values() for o in rendered]
    out = kubernetes_validate(objects, tmp_path)
    assert out.count(" passed for resource ") == len(objects)
    assert {o["kind"] for o in objects} >= {"Namespace", "DaemonSet", "ConfigMap", "Deployment"}


def test_kubernetes_validate_refuses_an_unknown_field(
    fleet: list[dict[str, Any]], tmp_path: Path
) -> None:
    (daemonset,) = by_kind(fleet, "DaemonSet")
    bad = json.loads(json.dumps(daemonset))
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privilegd"] = False
    with pytest.raises(AssertionError, match="privilegd"):
        kubernetes_validate([bad], tmp_path)


# ---------------------------------------------------------------- prometheus-operator kinds


def strict(schema: Any) -> Any:
    """An openAPIV3Schema as JSON Schema that refuses unknown fields (as the API server's
    structural pruning drops them) and takes `nullable`."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict schema, from the vendored CRDs."""
    out = {}
    for path in sorted(CRDS.glob("monitoring.coreos.com_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            api = f"{crd['spec']['group']}/{version['name']}"
            out[(api, crd["spec"]["names"]["kind"])] = strict(version["schema"]["openAPIV3Schema"])
    return out


def operator_errors(obj: dict[str, Any]) -> list[str]:
    schema = crd_schemas()[(obj["apiVersion"], obj["kind"])]
    validator = jsonschema.Draft7Validator(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]


def test_operator_kinds_pass_their_crd_schemas(fleet: list[dict[str, Any]]) -> None:
    objects = [o for o in fleet if is_operator_kind(o)]
    assert sorted(o["kind"] for o in objects) == ["PodMonitor", "PodMonitor", "PrometheusRule"]
    for obj in objects:
        assert obj["metadata"]["name"] and obj["metadata"]["namespace"] == "hostpool"
        assert operator_errors(obj) == [], obj["metadata"]["name"]


def test_crd_validation_refuses_unknown_and_missing_fields(fleet: list[dict[str, Any]]) -> None:
    (monitor, *_) = by_kind(fleet, "PodMonitor")
    bad = json.loads(json.dumps(monitor))
    bad["spec"]["podMetricsEndpoints"][0]["scrapeTimout"] = "10s"
    assert any("scrapeTimout" in e for e in operator_errors(bad))
    (rule,) = by_kind(fleet, "PrometheusRule")
    bad = json.loads(json.dumps(rule))
    del bad["spec"]["groups"][0]["name"]  # required by the CRD
    assert any("'name' is a required property" in e for e in operator_errors(bad))


# ---------------------------------------------------------------- the PrometheusRule


def test_prometheusrule_is_the_rule_files_groups() -> None:
    """One source: the generated file is what tools/kubernetes_rules.py writes now."""
    proc = subprocess.run(
        [sys.executable, "tools/kubernetes_rules.py", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rule = yaml.safe_load((KUBE / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == kubernetes_rules.groups()
    names = [g["name"] for g in rule["spec"]["groups"]]
    assert names == ["hostpool.alerts", "hostpool.recording"]


def test_drift_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alerts = tmp_path / "alerts.yml"
    alerts.write_text(kubernetes_rules.SOURCES[0].read_text().replace("for: 5m", "for: 6m", 1))
    monkeypatch.setattr(kubernetes_rules, "SOURCES", (alerts, kubernetes_rules.SOURCES[1]))
    assert kubernetes_rules.main(["--check"]) == 1


@needs_promtool
def test_prometheusrule_groups_pass_promtool_and_the_rule_unit_tests(tmp_path: Path) -> None:
    rule = yaml.safe_load((KUBE / "prometheusrule.yaml").read_text())
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    check = subprocess.run(
        ["promtool", "check", "rules", "rules.yml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "tests").mkdir()
    tests = []
    for path in sorted((ROOT / "metrics" / "tests").glob("*.yml")):
        unit = yaml.safe_load(path.read_text())
        unit["rule_files"] = ["../rules.yml"]
        (tmp_path / "tests" / path.name).write_text(yaml.safe_dump(unit))
        tests.append(f"tests/{path.name}")
    assert tests
    run = subprocess.run(
        ["promtool", "test", "rules", *tests],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


# ---------------------------------------------------------------- one value each

SETTINGS = {
    "release": "kube-prometheus-stack",
    "runbookURL": "https://docs.example/hostpool/runbook/",
}


def settings() -> dict[str, str]:
    """The kustomization's settings literals, and its namespace."""
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert generator["name"] == "hostpool-settings"
    values = dict(literal.split("=", 1) for literal in generator["literals"])
    return {"namespace": kustomization["namespace"], **values}


def test_the_settings_are_one_value_each(tmp_path: Path) -> None:
    """The namespace, the release label and the runbook URL, each changed in its one
    place (deploy/kubernetes/kustomization.yaml), change everywhere they are rendered,
    and the old values are gone."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: `make kubectl` installs it")
    before = settings()
    assert before == {"namespace": "hostpool", **SETTINGS}
    # the rendered folder and what it reads outside itself (../../dashboards)
    shutil.copytree(KUBE, tmp_path / "deploy" / "kubernetes")
    shutil.copytree(ROOT / "dashboards", tmp_path / "dashboards")
    kustomization = tmp_path / "deploy" / "kubernetes" / "kustomization.yaml"
    text = kustomization.read_text()
    after = {"namespace": "obs-hostpool", "release": "prom-main",
             "runbookURL": "https://wiki.internal/hostpool/runbook.html"}  # fmt: skip
    text = text.replace("namespace: hostpool\n", f"namespace: {after['namespace']}\n")
    for key in SETTINGS:
        text = text.replace(f"{key}={before[key]}", f"{key}={after[key]}")
    kustomization.write_text(text)
    objects = render(kustomization.parent)
    for obj in objects:
        meta = obj["metadata"]
        if obj["kind"] == "Namespace":
            assert meta["name"] == after["namespace"]
        else:
            assert meta["namespace"] == after["namespace"], (obj["kind"], meta["name"])
    operator = [o for o in objects if is_operator_kind(o)]
    assert {o["metadata"]["labels"]["release"] for o in operator} == {after["release"]}
    (rule,) = by_kind(objects, "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]
            if "alert" in r]  # fmt: skip
    assert urls and all(u.startswith(after["runbookURL"] + "#") for u in urls), urls
    rendered = yaml.safe_dump_all(objects)
    for key, old in before.items():
        if key != "namespace":  # "hostpool" is in every name
            assert old not in rendered, key
    assert "hostpool-settings" not in rendered  # kustomize's own, never applied


def runbook_anchors() -> dict[str, set[str]]:
    """The anchors of docs/runbook.md's headings as MkDocs renders them (Python-Markdown's
    toc extension, MkDocs' default) and as GitHub does (lower case, punctuation but - and
    _ dropped, spaces to -)."""
    import markdown

    text = (ROOT / "docs" / "runbook.md").read_text()
    md = markdown.Markdown(extensions=["toc"])
    md.convert(text)

    def ids(tokens: list[dict[str, Any]]) -> set[str]:
        return {t["id"] for t in tokens} | {i for t in tokens for i in ids(t["children"])}

    headings = re.findall(r"^#+ (.+)$", text, re.M)
    github = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    return {"mkdocs": ids(md.toc_tokens), "github": github}


def test_every_alert_links_to_its_runbook_section(fleet: list[dict[str, Any]]) -> None:
    """The rendered rules: the runbook URL setting, then `#` and an anchor that exists in
    docs/runbook.md, on MkDocs' site and on GitHub alike; the anchor is the alert's name."""
    base = settings()["runbookURL"]
    anchors = runbook_anchors()
    (rule,) = by_kind(fleet, "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 10
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        page, anchor = url.split("#")
        assert page == base, alert["alert"]
        assert anchor == alert["alert"].lower()
        assert anchor in anchors["mkdocs"] and anchor in anchors["github"], alert["alert"]


def test_runbook_anchor_check_can_fail() -> None:
    anchors = runbook_anchors()
    assert "hostpooltargetdown" in anchors["mkdocs"] and "hostpooltargetdown" in anchors["github"]
    assert "hostpoolnosuchalert" not in anchors["mkdocs"] | anchors["github"]


# ---------------------------------------------------------------- the engine PodMonitor


def test_the_engine_podmonitor_keeps_only_hostpools_series(fleet: list[dict[str, Any]]) -> None:
    (monitor,) = [m for m in by_kind(fleet, "PodMonitor") if m["metadata"]["name"].endswith(
        "engines")]  # fmt: skip
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["metricRelabelings"] == [
        {"sourceLabels": ["__name__"], "regex": "hostpool_.*", "action": "keep"}
    ]
    # Prometheus anchors the regex: what an engine's /metrics has, kept or not
    keep = endpoint["metricRelabelings"][0]["regex"]
    names = {"hostpool_allocated_bytes": True, "hostpool_build_info": True,
             "vllm:kv_offload_store_bytes_total": False, "process_open_fds": False,
             "python_gc_objects_collected_total": False, "sglang:num_running_reqs": False,
             "my_hostpool_x": False}  # fmt: skip
    assert {n: bool(re.fullmatch(keep, n)) for n in names} == names


# ---------------------------------------------------------------- the dashboards


def test_dashboards_configmap_holds_every_dashboard_as_it_is(fleet: list[dict[str, Any]]) -> None:
    kustomization = yaml.safe_load((ROOT / "dashboards" / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    files = sorted(p.name for p in (ROOT / "dashboards").glob("*.json"))
    assert sorted(generator["files"]) == files
    (configmap,) = by_kind(fleet, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(configmap["data"]) == files
    for name in files:
        assert configmap["data"][name] == (ROOT / "dashboards" / name).read_text()


# ---------------------------------------------------------------- the exporter DaemonSet


def test_exporter_daemonset_reads_the_host_with_the_fewest_capabilities(
    fleet: list[dict[str, Any]],
) -> None:
    (daemonset,) = by_kind(fleet, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["hostPID"] is True
    security = container["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"], "add": CAPABILITIES}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "hostNetwork" not in pod and "hostPort" not in container["ports"][0]
    args = container["args"]
    assert args[:2] == ["exporter", "--node"]
    (port,) = container["ports"]
    assert port["name"] == "metrics"
    assert args[args.index("--port") + 1] == str(port["containerPort"])
    # the pod's own address, from the downward API: never 0.0.0.0, never the node's
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert args[args.index("--listener-user") + 1] == "65534"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


def test_only_the_monitoring_namespace_reaches_the_exporter(fleet: list[dict[str, Any]]) -> None:
    """The NetworkPolicy selects the DaemonSet's pods: in, only from the monitoring
    namespace and only to the metrics port; out, nothing."""
    (daemonset,) = by_kind(fleet, "DaemonSet")
    (policy,) = by_kind(fleet, "NetworkPolicy")
    spec = policy["spec"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["egress"] == []
    (rule,) = spec["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert rule["ports"] == [{"protocol": "TCP", "port": container["ports"][0]["name"]}]


def test_exporter_runs_on_every_node_first_in_line(fleet: list[dict[str, Any]]) -> None:
    """Every taint tolerated (GPU nodes, control planes, NoExecute of a node under
    pressure), and the priority of a node agent."""
    (daemonset,) = by_kind(fleet, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["priorityClassName"] == "system-node-critical"


def test_images_are_set_through_kustomize(
    fleet: list[dict[str, Any]], examples: dict[str, list[dict[str, Any]]]
) -> None:
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    assert image["name"] == "hostpool" and image["newTag"] == version
    (daemonset,) = by_kind(fleet, "DaemonSet")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{image['newName']}:{version}"
    for rendered in examples.values():
        for pod in pod_specs(rendered):
            for c in pod.get("initContainers", []) + pod["containers"]:
                assert c["image"].endswith(f"hostpool:{version}"), c["image"]


def test_containerfile_builds_from_the_wheel_and_runs_hostpool() -> None:
    text = (ROOT / "Containerfile").read_text()
    assert re.search(r"^ARG BASE=", text, re.M)
    # a plain install (hostpool requires no torch: an engine's image has its own), what the
    # base image holds kept as it is (its packages are constraints), no --no-deps workaround
    assert re.search(
        r"pip install --no-cache-dir -c /tmp/installed.txt /tmp/wheels/hostpool-\*\.whl", text
    )
    run = text[text.index("\nRUN ") :].split("\nENV", 1)[0]
    assert "--no-deps" not in run and "torch" not in run, run
    assert re.search(r'^ENTRYPOINT \["hostpool"\]', text, re.M)
    page = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "Containerfile" in page and "not built in CI" in page


# ---------------------------------------------------------------- hostpool's flags and paths


def pod_specs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Deployment", "DaemonSet")
    ]


def hostpool_argv(container: dict[str, Any]) -> list[str] | None:
    """The hostpool arguments a container runs (the image's entrypoint is hostpool)."""
    command = container.get("command")
    if command:
        return (
            list(command[1:]) + list(container.get("args", []))
            if command[0] == "hostpool"
            else None
        )
    return list(container.get("args", []))


def test_every_hostpool_flag_and_path_exists(
    fleet: list[dict[str, Any]], examples: dict[str, list[dict[str, Any]]]
) -> None:
    parser = build_parser()
    seen = set()
    for objects in [fleet, *examples.values()]:
        for pod in pod_specs(objects):
            for container in pod.get("initContainers", []) + pod["containers"]:
                argv = hostpool_argv(container)
                if argv is None:
                    continue
                args = parser.parse_args(argv)  # SystemExit on an unknown flag or value
                seen.add(args.command)
                mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
                for path in getattr(args, "dir", None) or []:
                    assert path in mounts, (container["name"], path)
    assert seen == {"exporter", "reap", "run"}
    for sub in sorted(seen):
        proc = subprocess.run(
            [sys.executable, "-m", "hostpool", sub, "--help"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- the engine examples


def doctor_patch(argv: list[str], *, engine_memory: str, shm_extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "hostpool", "doctor", "--kubernetes", "--json",
         "--engine-memory", engine_memory, "--shm-extra", shm_extra, "--container", "vllm",
         "--", *argv],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # judged by the patch alone: exit 0 whatever this host has (no --check-host)
    assert proc.returncode == 0, proc.stderr
    patch: dict[str, Any] = json.loads(proc.stdout)["patch"]
    return patch


def test_doctor_judges_each_rendered_example_as_written(
    examples: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """`doctor --kubernetes --pod` on what kustomize renders: its one container and its
    command read from the manifest, every check of the pod spec passes."""
    for name, objects in examples.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(objects))
        said = "".join(f.read_text() for f in (KUBE / "examples" / name).glob("*.yaml"))
        sized_by = re.search(r"--engine-memory (\S+) --shm-extra (\S+)", said)
        assert sized_by is not None, name
        proc = subprocess.run(
            [sys.executable, "-m", "hostpool", "doctor", "--kubernetes", "--json", "--pod",
             str(path), "--engine-memory", sized_by[1], "--shm-extra", sized_by[2]],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, (name, proc.stdout[-2000:], proc.stderr)
        report = json.loads(proc.stdout)
        assert [c["check"] for c in report["checks"] if not c["ok"]] == [], name
        assert len(report["checks"]) >= 3


def test_vllm_examples_start_clean_and_hold_what_doctor_sizes(
    examples: dict[str, list[dict[str, Any]]],
) -> None:
    assert set(examples) == {"vllm", "vllm-hugepages"}
    for name, objects in examples.items():
        (pod,) = pod_specs(objects)
        (init,) = pod["initContainers"]
        assert init["command"][:3] == ["hostpool", "reap", "--yes"]
        (engine,) = pod["containers"]
        command = engine["command"]
        assert command[:4] == ["hostpool", "run", "--reap", "--"] and command[4] == "vllm"
        # hostpool's offloading spec: its series on vLLM's /metrics, which the engine
        # PodMonitor scrapes (tests/vllm/test_example_server.py runs this command line)
        transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
        extra = transfer["kv_connector_extra_config"]
        assert extra["spec_module_path"] == "hostpool.integrations.vllm"
        assert extra["spec_name"] == "HostpoolOffloadingSpec"
        (volume,) = pod["volumes"]
        assert volume["emptyDir"]["medium"] == "Memory"
        assert {"name": volume["name"], "mountPath": "/dev/shm"} in engine["volumeMounts"]
        resources = engine["resources"]
        assert resources["requests"] == resources["limits"]
        # the doctor command each example says it was sized by, in its comments
        said = "".join(f.read_text() for f in (KUBE / "examples" / name).glob("*.yaml"))
        sized_by = re.search(r"--engine-memory (\S+) --shm-extra (\S+) --container vllm", said)
        assert sized_by is not None, name
        memory, extra = sized_by.groups()
        patch = doctor_patch(command, engine_memory=memory, shm_extra=extra)
        (want,) = patch["spec"]["template"]["spec"]["containers"]
        for key, value in want["resources"]["limits"].items():
            assert resources["limits"][key] == value, (name, key)
        (want_volume,) = patch["spec"]["template"]["spec"]["volumes"]
        assert volume["emptyDir"] == want_volume["emptyDir"], name
    # the hugepages example asks for the pages its pool requires, outside memory
    (pod,) = pod_specs(examples["vllm-hugepages"])
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits["hugepages-2Mi"] == "64Gi" and limits["memory"] == "52Gi"


def test_target_down_waits_out_the_examples_load_window(
    examples: dict[str, list[dict[str, Any]]],
) -> None:
    """HostpoolTargetDown leaves a new target alone for as long as the example's
    startupProbe lets its model load (the promtool case in metrics/tests/alerts_test.yml
    shows a 14-minute load not paging)."""
    rules = yaml.safe_load((ROOT / "metrics" / "alerts.yml").read_text())["groups"][0]["rules"]
    (down,) = [r for r in rules if r.get("alert") == "HostpoolTargetDown"]
    # the range of "never up" and the offset of "not there before": one window
    (window,) = {int(m) for m in re.findall(r"(?:\[|offset )(\d+)m", down["expr"])}
    for objects in examples.values():
        (pod,) = pod_specs(objects)
        probe = pod["containers"][0]["startupProbe"]
        assert probe["failureThreshold"] * probe["periodSeconds"] <= window * 60


def _quantity(text: str) -> float:
    """A Kubernetes quantity as a number (bytes, CPUs)."""
    units = {"m": 1e-3, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


def test_exporter_resources_cover_the_bench(fleet: list[dict[str, Any]]) -> None:
    """bench/exporter_pod.py measured the exporter at the host-view bench's scale."""
    bench = json.loads((ROOT / "bench" / "results" / "exporter_pod.json").read_text())
    assert bench["scale"] == {
        "processes": 200, "fds": 500, "files": 5000, "sysv": 500, "namespaces": 20
    }  # fmt: skip
    (daemonset,) = by_kind(fleet, "DaemonSet")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    requests = {k: _quantity(v) for k, v in container["resources"]["requests"].items()}
    limits = {k: _quantity(v) for k, v in container["resources"]["limits"].items()}
    assert requests["memory"] >= bench["peak_rss_bytes"]
    assert limits["memory"] >= 2 * bench["peak_rss_bytes"]
    (monitor,) = [m for m in by_kind(fleet, "PodMonitor") if m["metadata"]["name"].endswith(
        "exporter")]  # fmt: skip
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    interval = _quantity(endpoint["interval"].removesuffix("s"))
    assert requests["cpu"] >= bench["cpu_s_max"] / interval
    # at the limit, the heaviest scrape takes under half the exporter's budget (5 s)
    assert limits["cpu"] * 5 >= 2 * bench["cpu_s_max"]


# torch's import fails; then the hostpool command line
WITHOUT_TORCH = """
import runpy, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not in this image")
sys.meta_path.insert(0, NoTorch())
sys.argv = ["hostpool", *sys.argv[1:]]
runpy.run_module("hostpool", run_name="__main__")
"""


def test_what_the_image_runs_needs_no_torch() -> None:
    """The Containerfile installs hostpool without torch: every command the manifests run
    (and shm, doctor) works with torch's import failing. (`run --reap` would remove
    orphans on this host: its reaping is the reap dry run's code.)"""
    from tests.kubeview import _scrape

    for argv in (["shm", "--json"], ["reap", "--min-age", "0"], ["run", "--", "true"],
                 ["doctor", "--kubernetes", "--check-host", "--container", "vllm", "--", "vllm",
                  "serve", "m", "--kv-offloading-size", "1"]):  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-c", WITHOUT_TORCH, *argv],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode in (0, 1), (argv, proc.stderr[-2000:])
        assert "torch is not in this image" not in proc.stderr, argv
    exporter = [sys.executable, "-c", WITHOUT_TORCH, "exporter", "--node", "--host", "127.0.0.1",
                "--port", "0"]  # fmt: skip
    _scrape(exporter)  # raises with the exporter's stderr if it could not serve a scrape
