"""Prometheus rules and config: promtool's checks and unit tests, and the conventions.

The promtool tests skip only where promtool is missing (`make prometheus` installs
Debian's package, promtool 2.42); the convention checks run everywhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import dashboard_lint as lint

ROOT = lint.ROOT
METRICS = ROOT / "metrics"
ALERTS = METRICS / "alerts.yml"
RECORDING = METRICS / "recording.yml"
CONFIG = METRICS / "prometheus.yml"
UNIT_TESTS = sorted((METRICS / "tests").glob("*.yml"))
RUNBOOK_BASE = "file:///opt/hostpool/docs/runbook.md#"
SEVERITIES = {"critical", "warning", "info"}
RECORD_NAME = re.compile(r"[a-z][a-z0-9_]*:[a-z][a-z0-9_]*:[a-z0-9_]+")

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed: `make prometheus` installs Debian's prometheus package",
)


def load_rules(path: Path) -> list[dict[str, Any]]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"]]


ALERT_RULES = load_rules(ALERTS)
RECORD_RULES = load_rules(RECORDING)


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


# ---------------------------------------------------------------- promtool


@needs_promtool
def test_rules_are_valid() -> None:
    result = promtool("check", "rules", str(ALERTS), str(RECORDING))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_rule_unit_tests_pass() -> None:
    assert len(UNIT_TESTS) >= 2
    result = promtool("test", "rules", *map(str, UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(UNIT_TESTS)


@needs_promtool
def test_rule_unit_tests_can_fail(tmp_path: Path) -> None:
    """A wrong expectation must fail promtool (the exit status is what the tests trust)."""
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    case = {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": 'up{job="hostpool", instance="a"}', "values": "1x20"}],
                "alert_rule_test": [
                    {
                        "eval_time": "15m",
                        "alertname": "HostpoolTargetDown",
                        "exp_alerts": [{"exp_labels": {"severity": "critical"}}],
                    }
                ],
            }
        ],
    }
    (tmp_path / "wrong_test.yml").write_text(yaml.safe_dump(case))
    result = promtool("test", "rules", "wrong_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "FAILED" in result.stdout + result.stderr


@needs_promtool
def test_prometheus_config_is_valid() -> None:
    result = promtool("check", "config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rule files found" in result.stdout


# ---------------------------------------------------------------- config contents


def test_prometheus_config_scrapes_serve_and_exporter() -> None:
    config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    assert config["rule_files"] == ["alerts.yml", "recording.yml"]
    for name in config["rule_files"]:
        assert (CONFIG.parent / name).is_file()
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets == {"hostpool": ["127.0.0.1:9464"], "hostpool-exporter": ["127.0.0.1:9465"]}
    # HostpoolTargetDown must cover every job the example configures.
    down = next(r for r in ALERT_RULES if r["alert"] == "HostpoolTargetDown")
    job_regex = dict((k, v) for k, _, v in lint.matchers(down["expr"]))["job"]
    for job in targets:
        assert re.fullmatch(job_regex, job), job
    # The multi-host example is there, commented out.
    text = CONFIG.read_text(encoding="utf-8")
    assert re.search(r"^\s*#\s*- job_name: hostpool\s*$", text, re.MULTILINE)
    assert "gpu-node-2:9464" in text


# ---------------------------------------------------------------- alert conventions


def alert_problems(rule: dict[str, Any]) -> list[str]:
    """What an alert rule lacks under the project's conventions (empty when it is fine)."""
    name = str(rule.get("alert", ""))
    problems = []
    if not re.fullmatch(r"Hostpool[A-Z][A-Za-z0-9]*", name):
        problems.append(f"{name!r}: not a CamelCase name starting with Hostpool")
    if rule.get("labels", {}).get("severity") not in SEVERITIES:
        problems.append(f"{name}: severity label not one of {sorted(SEVERITIES)}")
    annotations = rule.get("annotations", {})
    summary = str(annotations.get("summary", ""))
    if not summary.strip() or "{{" in summary:
        problems.append(f"{name}: summary missing or templated (it must be static)")
    if "{{" not in str(annotations.get("description", "")):
        problems.append(f"{name}: description missing or not templated")
    if annotations.get("runbook_url") != RUNBOOK_BASE + name.lower():
        problems.append(f"{name}: runbook_url is not {RUNBOOK_BASE + name.lower()}")
    return problems


REQUIRED_ALERTS = {
    "HostpoolFinalizerReleases",
    "HostpoolAllocationFailures",
    "HostpoolHugepageFallbacks",
    "HostpoolResidentFarBelowAllocated",
    "HostpoolReleasedMappedGrowing",
    "HostpoolOpenFdsNearLimit",
    "HostpoolBudgetNearlyUsed",
    "HostpoolTargetDown",
}


def test_required_alerts_exist() -> None:
    names = [r["alert"] for r in ALERT_RULES]
    assert len(names) == len(set(names))
    assert REQUIRED_ALERTS - set(names) == set()


@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: r["alert"])
def test_alert_conventions(rule: dict[str, Any]) -> None:
    assert alert_problems(rule) == []


GOOD = {
    "alert": "HostpoolExample",
    "expr": "up == 0",
    "labels": {"severity": "warning"},
    "annotations": {
        "summary": "Static.",
        "description": "On {{ $labels.instance }}.",
        "runbook_url": RUNBOOK_BASE + "hostpoolexample",
    },
}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"alert": "hostpoolExample"}, "not a CamelCase name"),
        ({"alert": "PoolExample"}, "not a CamelCase name"),
        ({"labels": {}}, "severity label"),
        ({"labels": {"severity": "page"}}, "severity label"),
        ({"annotations": {**GOOD["annotations"], "summary": "On {{ $labels.pool }}"}}, "summary"),
        ({"annotations": {**GOOD["annotations"], "description": "Static."}}, "description"),
        ({"annotations": {**GOOD["annotations"], "runbook_url": RUNBOOK_BASE}}, "runbook_url"),
    ],
)
def test_alert_conventions_catch(change: dict[str, Any], expected: str) -> None:
    assert alert_problems(GOOD) == []
    assert any(expected in p for p in alert_problems({**GOOD, **change}))


# ---------------------------------------------------------------- unit test coverage


def alert_cases() -> dict[str, list[bool]]:
    """alertname -> for each promtool case of it, whether the alert is expected to fire."""
    cases: dict[str, list[bool]] = {}
    for path in UNIT_TESTS:
        for test in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.setdefault(case["alertname"], []).append(bool(case.get("exp_alerts")))
    return cases


def test_every_alert_is_tested_firing_and_silent() -> None:
    cases = alert_cases()
    names = {r["alert"] for r in ALERT_RULES}
    assert set(cases) - names == set(), "unit tests name alerts that do not exist"
    for name in sorted(names):
        assert True in cases.get(name, []), f"{name}: no case where it fires"
        assert False in cases.get(name, []), f"{name}: no case where it stays silent"


def test_every_recording_rule_is_tested() -> None:
    tested = set()
    for path in UNIT_TESTS:
        for test in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for case in test.get("promql_expr_test", []):
                if case.get("exp_samples"):
                    tested |= lint.metric_names(case["expr"])
    assert {r["record"] for r in RECORD_RULES} - tested == set()


@pytest.mark.parametrize("rule", RECORD_RULES, ids=lambda r: r["record"])
def test_record_names_follow_level_metric_operations(rule: dict[str, Any]) -> None:
    assert RECORD_NAME.fullmatch(rule["record"])
    level, metric, _ = rule["record"].split(":")
    # The level lists the labels kept (besides job), the metric part names its source.
    assert metric.startswith(("hostpool_", "process_"))
    kept = set(level.split("_")) - {"instance", "pool"}
    # `pod`: the node view's pod (pod_uid, with namespace and pod from kube_pod_info)
    assert kept <= {"how", "reason", "le", "limit", "pod", "engine", "area", "state"}


def test_rule_expressions_use_known_metrics_and_rate_counters() -> None:
    catalogue = lint.load_catalogue()
    recorded = frozenset(r["record"] for r in RECORD_RULES)
    problems = []
    for rule in ALERT_RULES + RECORD_RULES:
        expr = rule["expr"]
        problems += lint.catalogue_problems(expr, catalogue, extra=recorded)
        problems += lint.counter_problems(expr, catalogue)
    assert problems == []
    # ...and the checks bite.
    bad = "sum(hostpool_releases_total) > hostpool_made_up"
    assert len(lint.counter_problems(bad, catalogue)) == 1
    assert len(lint.catalogue_problems(bad, catalogue, extra=recorded)) == 1


# ---------------------------------------------------------------- runbook and catalogue


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def runbook_headings() -> tuple[Path, list[str]]:
    """The `##` headings of the runbook page (docs/runbook.md, titled `# Runbook`)."""
    path = ROOT / "docs" / "runbook.md"
    text = path.read_text(encoding="utf-8")
    if not re.match(r"# Runbook[ \t]*\n", text):
        pytest.fail(f"{path} is not the runbook page (no `# Runbook` title)")
    return path, re.findall(r"^## (.+?)\s*$", text, re.MULTILINE)


def test_runbook_has_a_section_per_alert() -> None:
    path, headings = runbook_headings()
    anchors = {github_anchor(h) for h in headings}
    for rule in ALERT_RULES:
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(RUNBOOK_BASE)
        assert url.removeprefix(RUNBOOK_BASE) in anchors, f"{rule['alert']}: no section in {path}"
    # No stale sections either.
    assert sorted(headings) == sorted(r["alert"] for r in ALERT_RULES)


def test_github_anchor() -> None:
    assert github_anchor("HostpoolFinalizerReleases") == "hostpoolfinalizerreleases"
    assert github_anchor("Budget: nearly used") == "budget-nearly-used"


def test_catalogue_matches_the_library() -> None:
    """metrics/README.md lists exactly what hostpool.metrics exports, types and labels."""
    from hostpool.metrics import collector as metrics

    catalogue = lint.load_catalogue()
    # as exposed: a counter's samples carry `_total`
    exposed = {
        name: name + ("_total" if kind == "counter" else "")
        for name, (kind, *_) in metrics.METRICS.items()
    }
    exported = {
        exposed[name]: lint.Metric(exposed[name], kind, tuple(labels))
        for name, (kind, labels, _help) in metrics.METRICS.items()
    }
    # the exporter's (--node's too) and `hostpool serve`'s own metrics are not the library
    # collector's (tests/test_exporter_node.py checks the node view's against its collector)
    own = (
        "hostpool_exporter_",
        "hostpool_host_",
        "hostpool_serve_",
        "hostpool_vllm_",
        "hostpool_broker_",
    )
    library = {k: v for k, v in catalogue.items() if not k.startswith(own)}
    assert library == exported


def test_catalogue_documents_the_fixed_reason_sets() -> None:
    from hostpool.words import FAILURE_REASONS, FALLBACK_REASONS

    text = (METRICS / "README.md").read_text(encoding="utf-8")
    for reason in (*FAILURE_REASONS, *FALLBACK_REASONS):
        assert re.search(rf"^\| `{reason}` \|", text, re.MULTILINE), reason
