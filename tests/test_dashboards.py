"""The generated Grafana dashboard: up to date, deterministic, and clean under the lint."""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import dashboard_lint as lint

ROOT = lint.ROOT
BUILD = ROOT / "dashboards" / "build.py"
POOL_SEL = 'job=~"$job", instance=~"$instance", pool=~"$pool"'

Dashboard = dict[str, Any]


@pytest.fixture(scope="module")
def dashboard() -> Dashboard:
    return lint.load_dashboard()


@pytest.fixture(scope="module")
def catalogue() -> dict[str, lint.Metric]:
    return lint.load_catalogue()


def run_build(*args: str, seed: str = "0") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    return subprocess.run(
        [sys.executable, str(BUILD), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )


# ---------------------------------------------------------------- generation


def test_committed_dashboard_is_up_to_date() -> None:
    result = run_build("--check")
    assert result.returncode == 0, result.stderr


def test_generation_is_byte_identical_across_runs(tmp_path: Path) -> None:
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"hostpool-{seed}.json"
        result = run_build("--output", str(out), seed=seed)
        assert result.returncode == 0, result.stderr
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1] == lint.DASHBOARD_PATH.read_bytes()
    assert outputs[0].endswith(b"}\n")


def test_dashboard_round_trips_through_the_sdk_model(dashboard: Dashboard) -> None:
    """The committed JSON fits the Grafana schema the SDK models (no stray hand edits)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard as Model

    assert json.loads(json.dumps(Model.from_json(dashboard), cls=JSONEncoder)) == dashboard
    edited = copy.deepcopy(dashboard)
    edited["panels"][1]["gridPosition"] = {"h": 1}
    assert json.loads(json.dumps(Model.from_json(edited), cls=JSONEncoder)) != edited


def test_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "hostpool.json"
    stale.write_bytes(lint.DASHBOARD_PATH.read_bytes().replace(b"Pinned bytes", b"Pinned"))
    result = run_build("--check", "--output", str(stale))
    assert result.returncode == 1
    assert "out of date" in result.stderr
    assert run_build("--check", "--output", str(tmp_path / "missing.json")).returncode == 1


# ---------------------------------------------------------------- the dashboard itself


def test_dashboard_passes_the_lint(dashboard: Dashboard, catalogue: dict[str, lint.Metric]) -> None:
    assert lint.lint(dashboard, catalogue) == []


def test_identity_and_ids(dashboard: Dashboard) -> None:
    assert dashboard["uid"] == "hostpool-overview"
    ids = [p["id"] for p in lint.iter_panels(dashboard)]
    assert ids == list(range(1, len(ids) + 1))


def test_variables(dashboard: Dashboard) -> None:
    found = lint.variables(dashboard)
    assert list(found)[:4] == ["datasource", "job", "instance", "pool"]
    ds = found["datasource"]
    assert (ds["type"], ds["query"], ds["label"]) == ("datasource", "prometheus", "Data source")
    for name in ("job", "instance", "pool"):
        var = found[name]
        assert var["type"] == "query"
        assert var["query"].startswith("label_values(")
        assert var["refresh"] == 2  # on time range change
    assert found["pool"]["multi"] is True
    assert found["pool"]["includeAll"] is True
    assert 'job=~"$job"' in found["instance"]["query"]
    assert 'instance=~"$instance"' in found["pool"]["query"]


def test_rows(dashboard: Dashboard) -> None:
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == [
        "Overview",
        "Lifecycle",
        "Hugepages and populate",
        "Latency",
        "Budget",
        "Sharing",
        "Process and host context",
        "Exporter (other processes)",
        "Host shared memory",
    ]
    # Every row has panels under it (expanded rows: the panels that follow it).
    kinds = [p["type"] for p in dashboard["panels"]]
    assert kinds[-1] != "row"
    assert all(b != "row" for a, b in itertools.pairwise(kinds) if a == "row")


def test_required_content(dashboard: Dashboard) -> None:
    exprs = "\n".join(expr for _, expr in lint.panel_exprs(dashboard))
    kinds = {p["type"] for p in lint.content_panels(dashboard)}
    assert "heatmap" in kinds
    assert "histogram_quantile(0.99," in exprs
    assert 'how="finalizer"' in exprs
    for needle in ("process_open_fds", "process_max_fds", "node_memory_Shmem_bytes"):
        assert needle in exprs
    assert "node_memory_HugePages_Free" in exprs


def test_every_catalogue_metric_is_on_the_dashboard(
    dashboard: Dashboard, catalogue: dict[str, lint.Metric]
) -> None:
    used = set()
    for _, expr in lint.panel_exprs(dashboard):
        for name in lint.metric_names(expr):
            metric = lint.base_metric(name, catalogue)
            if metric is not None:
                used.add(metric.name)
    assert set(catalogue) - used == set()


def test_optional_panels_are_marked(dashboard: Dashboard) -> None:
    from dashboards import build

    derived = lint.optional_panels(dashboard)
    assert derived == build.OPTIONAL_PANELS
    assert {t for t, n in derived.items() if n == "node_exporter"} == build.NODE_EXPORTER_PANELS
    assert len(build.NODE_EXPORTER_PANELS) == 2
    assert build.EXPORTER_PANELS
    # the whole Host shared memory row is the node view's
    row = next(r for r in build.ROWS if r.title == "Host shared memory")
    assert {p.title for p in row.panels} == build.NODE_VIEW_PANELS
    descriptions = {p["title"]: p["description"] for p in lint.content_panels(dashboard)}
    for title in derived:
        assert "Empty unless" in descriptions[title]


def test_panel_queries_substitute_everything(dashboard: Dashboard) -> None:
    pairs = lint.panel_queries(dashboard, {"pool": "kv"}, rate_interval="30s")
    assert len(pairs) == sum(len(p["targets"]) for p in lint.content_panels(dashboard))
    assert all("$" not in expr for _, expr in pairs)
    assert any('pool=~"kv"' in expr and "[30s]" in expr for _, expr in pairs)
    assert any('job=~".*"' in expr for _, expr in pairs)
    broken = copy.deepcopy(dashboard)
    lint.content_panels(broken)[0]["targets"][0]["expr"] = 'up{job=~"$nope"}'
    with pytest.raises(ValueError, match="nope"):
        lint.panel_queries(broken)


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed: `make prometheus` installs Debian's prometheus package",
)
def test_every_query_parses(dashboard: Dashboard, tmp_path: Path) -> None:
    """Each substituted panel query and variable selector, checked by promtool's parser."""
    exprs = [expr for _, expr in lint.panel_queries(dashboard)]
    for var in lint.variables(dashboard).values():
        if var["type"] == "query":
            exprs.append(lint.substitute(lint.variable_selector(var), lint.ALL_VALUES, "1m"))
    rules = [{"record": f"dashboard_query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The check is real: a broken query fails it.
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "x", "expr": "sum(("}]}]})
    )
    assert subprocess.run(["promtool", "check", "rules", str(path)]).returncode != 0


# ---------------------------------------------------------------- the lint can fail


def _panel(d: Dashboard, title: str) -> dict[str, Any]:
    return next(p for p in lint.content_panels(d) if p["title"] == title)


def _set_expr(title: str, expr: str) -> Callable[[Dashboard], None]:
    def mutate(d: Dashboard) -> None:
        _panel(d, title)["targets"][0]["expr"] = expr

    return mutate


def _drop_datasource_variable(d: Dashboard) -> None:
    d["templating"]["list"] = [v for v in d["templating"]["list"] if v["name"] != "datasource"]


def _fixed_panel_datasource(d: Dashboard) -> None:
    _panel(d, "Live allocations")["datasource"] = {"type": "prometheus", "uid": "prom-1"}


def _fixed_target_datasource(d: Dashboard) -> None:
    _panel(d, "Live allocations")["targets"][0]["datasource"]["uid"] = "prom-1"


def _fixed_variable_datasource(d: Dashboard) -> None:
    lint.variables(d)["pool"]["datasource"]["uid"] = "prom-1"


def _fixed_range(d: Dashboard) -> None:
    target = _panel(d, "Allocation rate")["targets"][0]
    target["expr"] = target["expr"].replace("[$__rate_interval]", "[5m]")


def _no_unit(d: Dashboard) -> None:
    del _panel(d, "Live allocations")["fieldConfig"]["defaults"]["unit"]


def _no_description(d: Dashboard) -> None:
    _panel(d, "Live allocations")["description"] = " "


def _no_title(d: Dashboard) -> None:
    _panel(d, "Live allocations")["title"] = ""


def _no_targets(d: Dashboard) -> None:
    _panel(d, "Live allocations")["targets"] = []


def _empty_expr(d: Dashboard) -> None:
    _panel(d, "Live allocations")["targets"][0]["expr"] = ""


def _duplicate_id(d: Dashboard) -> None:
    _panel(d, "Live allocations")["id"] = _panel(d, "Pinned bytes")["id"]


def _duplicate_title(d: Dashboard) -> None:
    _panel(d, "Live allocations")["title"] = "Pinned bytes"


def _pool_single_value(d: Dashboard) -> None:
    lint.variables(d)["pool"]["multi"] = False


def _no_refresh(d: Dashboard) -> None:
    lint.variables(d)["instance"]["refresh"] = 1


def _no_job_variable(d: Dashboard) -> None:
    d["templating"]["list"] = [v for v in d["templating"]["list"] if v["name"] != "job"]


def _variable_unknown_metric(d: Dashboard) -> None:
    lint.variables(d)["pool"]["query"] = "label_values(hostpool_pools, pool)"


def _broken_panel_in_collapsed_row(d: Dashboard) -> None:
    panel = d["panels"].pop(d["panels"].index(_panel(d, "Attached clients")))
    panel["description"] = ""
    row = next(p for p in d["panels"] if p["type"] == "row" and p["title"] == "Sharing")
    row["collapsed"] = True
    row["panels"] = [panel]


MUTATIONS: dict[str, tuple[Callable[[Dashboard], None], str]] = {
    "no datasource variable": (_drop_datasource_variable, "no datasource variable"),
    "panel datasource fixed": (_fixed_panel_datasource, "datasource is not ${datasource}"),
    "target datasource fixed": (_fixed_target_datasource, "target A: datasource is not"),
    "variable datasource fixed": (_fixed_variable_datasource, "variable pool: datasource"),
    "fixed range": (_fixed_range, "range [5m] instead of [$__rate_interval]"),
    "raw counter": (
        _set_expr("Allocation rate", f"sum(hostpool_allocations_total{{{POOL_SEL}}})"),
        "hostpool_allocations_total outside rate()/increase() (inside sum())",
    ),
    "counter at top level": (
        _set_expr("Allocation rate", f"hostpool_releases_total{{{POOL_SEL}}}"),
        "hostpool_releases_total outside rate()/increase() (at top level)",
    ),
    "irate counter": (
        _set_expr(
            "Allocation rate",
            f"irate(hostpool_allocations_total{{{POOL_SEL}}}[$__rate_interval])",
        ),
        "outside rate()/increase() (inside irate())",
    ),
    "raw histogram bucket": (
        _set_expr(
            "Allocation duration quantiles",
            "histogram_quantile(0.9, sum by (le) "
            f"(hostpool_allocation_duration_seconds_bucket{{{POOL_SEL}}}))",
        ),
        "hostpool_allocation_duration_seconds_bucket outside rate()/increase()",
    ),
    "raw histogram count": (
        _set_expr(
            "Allocation duration quantiles",
            f"hostpool_allocation_duration_seconds_count{{{POOL_SEL}}}",
        ),
        "hostpool_allocation_duration_seconds_count outside",
    ),
    "unknown metric": (
        _set_expr("Live allocations", f"hostpool_live_regions{{{POOL_SEL}}}"),
        "hostpool_live_regions is not in the catalogue",
    ),
    "missing pool matcher": (
        _set_expr(
            "Live allocations", 'hostpool_live_allocations{job=~"$job", instance=~"$instance"}'
        ),
        'hostpool_live_allocations lacks the matcher pool=~"$pool"',
    ),
    "missing job matcher": (
        _set_expr("Process open fds vs limit", 'process_open_fds{instance=~"$instance"}'),
        'process_open_fds lacks the matcher job=~"$job"',
    ),
    "pool-less metric without instance": (
        _set_expr("Budget and reservations", 'hostpool_budget_bytes{job=~"$job"}'),
        'hostpool_budget_bytes lacks the matcher instance=~"$instance"',
    ),
    "node metric on the wrong variable": (
        _set_expr("Host Shmem (node_exporter)", 'node_memory_Shmem_bytes{instance=~"$instance"}'),
        'node_memory_Shmem_bytes lacks the matcher instance=~"$node"',
    ),
    "no unit": (_no_unit, "panel 'Live allocations': no unit"),
    "no description": (_no_description, "panel 'Live allocations': no description"),
    "no title": (_no_title, "no title"),
    "no targets": (_no_targets, "panel 'Live allocations': no targets"),
    "empty expression": (_empty_expr, "target A: no expression"),
    "duplicate id": (_duplicate_id, "is not unique"),
    "duplicate title": (_duplicate_title, "panel title 'Pinned bytes' is not unique"),
    "pool single-valued": (_pool_single_value, "variable pool: not multi-value with All"),
    "variable not refreshed": (_no_refresh, "variable instance: does not refresh"),
    "no job variable": (_no_job_variable, "no query variable `job`"),
    "variable on unknown metric": (_variable_unknown_metric, "hostpool_pools is not in the"),
    "nested panel checked": (_broken_panel_in_collapsed_row, "'Attached clients': no description"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_lint_catches(case: str, dashboard: Dashboard, catalogue: dict[str, lint.Metric]) -> None:
    mutate, expected = MUTATIONS[case]
    broken = copy.deepcopy(dashboard)
    mutate(broken)
    problems = lint.lint(broken, catalogue)
    assert any(expected in p for p in problems), problems


def test_catalogue_parsing(catalogue: dict[str, lint.Metric]) -> None:
    assert catalogue["hostpool_allocated_bytes"].labels == ("pool", "allocator", "page_size")
    assert catalogue["hostpool_allocation_duration_seconds"].type == "histogram"
    assert catalogue["hostpool_budget_bytes"].labels == ("limit",)
    assert catalogue["hostpool_budget_reserved_bytes"].labels == ()
    assert catalogue["hostpool_exporter_processes"].labels == ("prefix",)
    assert "up" not in catalogue  # only the metric tables count


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (pool) (rate(a_total{x="}{"}[5m]))', {"a_total"}),
        ("a / on (job, instance) group_left (version) b", {"a", "b"}),
        ("histogram_quantile(0.99, sum by (le) (rate(h_bucket[1m]))) > 1e-09", {"h_bucket"}),
        ('{__name__=~"x|y", job=~"$job"}', {"x", "y"}),
        ("count by (version) (build_info) and bool up", {"build_info", "up"}),
        (
            "instance_pool:hostpool_allocations:rate5m offset 5m",
            {"instance_pool:hostpool_allocations:rate5m"},
        ),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert lint.metric_names(expr) == names
