"""End to end: `hostpool serve --demo-load` and `hostpool exporter --node` scraped by a
real Prometheus on loopback; every dashboard target and every rule evaluated through
Prometheus's HTTP API."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests import dashboard_lint, exporting, helpers, waiting
from tests.helpers import prometheus_api
from tests.test_serve import start_serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRAPE = 1  # seconds
pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus not installed (make test installs it)"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("e2e")
    node = exporting.start_exporter("--node")
    node_target = node.url.removeprefix("http://").removesuffix("/metrics")
    try:
        served = start_serve(os.fspath(tmp), "--demo-load")
    except BaseException:
        node.stop()
        raise
    target = served.url.removeprefix("http://")
    config = os.path.join(tmp, "prometheus.yml")
    for name in ("alerts.yml", "recording.yml"):
        shutil.copy(os.path.join(ROOT, "metrics", name), tmp / name)
    with open(config, "w") as f:
        f.write(
            f"global:\n  scrape_interval: {SCRAPE}s\n  evaluation_interval: {SCRAPE}s\n"
            "rule_files: [alerts.yml, recording.yml]\n"
            f"scrape_configs:\n  - job_name: hostpool\n    static_configs:\n"
            f"      - targets: ['{target}']\n"
            f"  - job_name: hostpool-node\n    static_configs:\n"
            f"      - targets: ['{node_target}']\n"
        )
    try:
        with helpers.prometheus(config, tmp) as (prom, base):

            def ready() -> bool:
                """Enough samples for rate() over 4 scrape intervals, and the demo's
                provoked fallback and refusal (5 s after start) scraped."""
                try:
                    samples = prometheus_api(
                        base, "query", query="count_over_time(hostpool_build_info[1m])"
                    )
                    provoked = [
                        prometheus_api(base, "query", query=q)["result"]
                        for q in (
                            'hostpool_allocation_failures_total{pool="demo_refused"}',
                            "hostpool_hugepage_fallbacks_total",
                        )
                    ]
                except (OSError, AssertionError):
                    return False  # not listening yet
                enough = bool(samples["result"]) and float(samples["result"][0]["value"][1]) >= 5
                node_seen = prometheus_api(
                    base, "query", query="count_over_time(hostpool_host_shmem_bytes[1m])"
                )
                enough = enough and bool(node_seen["result"])
                enough = enough and float(node_seen["result"][0]["value"][1]) >= 5
                return enough and all(provoked)

            waiting.wait_for(ready, "prometheus scraping the demo", alive=prom, interval=0.5)
            yield base, served.url
    finally:
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=10) == 0
        node.stop()


def test_every_dashboard_target_evaluates(stack: tuple[str, str]) -> None:
    base, _ = stack
    dashboard = dashboard_lint.load_dashboard()
    optional = dashboard_lint.optional_panels(dashboard)
    queries = dashboard_lint.panel_queries(dashboard, rate_interval=f"{4 * SCRAPE}s")
    assert queries
    empty = []
    for title, expr in queries:
        data = prometheus_api(base, "query", query=expr)  # a bad query fails here with status error
        if not data["result"] and title not in optional:
            empty.append((title, expr))
    assert empty == []


def test_the_node_view_panels_have_data(stack: tuple[str, str]) -> None:
    """The Host shared memory row, on a real `exporter --node`: every panel but those of
    orphans (this host may have none) shows something."""
    from dashboards import build

    base, _ = stack
    dashboard = dashboard_lint.load_dashboard()
    queries = dashboard_lint.panel_queries(dashboard, rate_interval=f"{4 * SCRAPE}s")
    row = next(r for r in build.ROWS if r.title == "Host shared memory")
    wanted = {p.title for p in row.panels} - {"Orphaned shared memory", "Oldest orphan age"}
    wanted -= {"Host hugetlb objects"}  # only where something uses hugetlb pages
    # only on a Kubernetes node (tests/test_e2e_pods.py runs them with a pod)
    wanted -= {"Top pods by shared memory", "Orphans by pod"}
    empty = [
        (title, expr)
        for title, expr in queries
        if title in wanted
        # the phase a scan ran out of time in: a series only while one does
        and "hostpool_host_scrape_truncated_phase" not in expr
        and not prometheus_api(base, "query", query=expr)["result"]
    ]
    assert empty == []


# The alerts `--demo-load` exists to show (the demo's docstring names them).
DEMO_ALERTS = {
    "HostpoolAllocationFailures",
    "HostpoolHugepageFallbacks",
    "HostpoolFinalizerReleases",
}


def test_every_demo_alert_fires(stack: tuple[str, str]) -> None:
    """The shipped rules, unchanged, fire on the demo (which provokes every 10 s, so a
    rise always follows a sample, whatever the scrape interval)."""
    base, _ = stack
    query = 'hostpool_allocation_failures_total{pool="demo_refused"}'
    seen: dict[str, Any] = {}

    def all_fired() -> bool:
        alerts = prometheus_api(base, "alerts")["alerts"]
        seen["firing"] = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
        result = prometheus_api(base, "query", query=query)["result"]
        seen["refused"] = float(result[0]["value"][1]) if result else 0.0
        # Provoked more than once: each round is a rise of its own, seen on any interval.
        return seen["firing"] >= DEMO_ALERTS and seen["refused"] >= 2

    try:
        waiting.wait_for(all_fired, "every demo alert firing", interval=1.0)
    except AssertionError:
        raise AssertionError(f"fired {seen.get('firing')}, refused {seen.get('refused')}") from None


def test_every_rule_is_healthy(stack: tuple[str, str]) -> None:
    base, _ = stack
    groups = prometheus_api(base, "rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 10
    unhealthy = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert unhealthy == []
