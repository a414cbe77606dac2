"""A real Prometheus scrapes `hostpool serve` over mutual TLS with basic auth.

The scrape config is what an operator writes (`scheme: https`, `tls_config` with the CA
and a client certificate, `basic_auth`); a second job with a wrong password shows the
server's refusal reaches Prometheus as a 401, not as a silent gap.
"""

from __future__ import annotations

import json
import shutil
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests import helpers, tlspki, waiting
from tests.helpers import prometheus_api
from tests.test_web_config import MTLS_AUTH, PASSWORD, start, stop, write_config

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus not installed (make test installs it)"
)


def targets(base: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = prometheus_api(base, "targets")["activeTargets"]
    return found


def test_prometheus_scrapes_mutual_tls_with_basic_auth(tmp_path: Path) -> None:
    pki = tlspki.make(tmp_path)
    server = start(
        tmp_path,
        "serve",
        "--pool",
        "kv=4MiB",
        "--web-config-file",
        write_config(pki, MTLS_AUTH, "mtls.yml"),
    )
    target = urllib.parse.urlsplit(server.url).netloc

    def job(name: str, password: str) -> str:
        return (
            f"  - job_name: {name}\n"
            "    scheme: https\n"
            "    tls_config:\n"
            f"      ca_file: {pki / 'ca.crt'}\n"
            f"      cert_file: {pki / 'client.crt'}\n"
            f"      key_file: {pki / 'client.key'}\n"
            f"    basic_auth:\n      username: alice\n      password: {json.dumps(password)}\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )

    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
        + job("hostpool", PASSWORD)
        + job("wrong-password", "not it")
    )
    try:
        with helpers.prometheus(config, tmp_path) as (prom, base):

            def scraped() -> dict[str, dict[str, Any]] | None:
                try:
                    found = {t["labels"]["job"]: t for t in targets(base)}
                except OSError:
                    return None  # not listening yet
                # Steady state: a first login that lands in the rest after the other job's
                # failed bcrypt round is a 503 with Retry-After (net/basicauth), so the good
                # job may need a second scrape; from then on its success is remembered.
                done = len(found) == 2 and found.get("hostpool", {}).get("health") == "up"
                return found if done and found["wrong-password"]["health"] != "unknown" else None

            found = waiting.wait_for(scraped, "the good job up", alive=prom, interval=0.5)
            good, bad = found["hostpool"], found["wrong-password"]
            assert (good["health"], good["lastError"], good["scrapeUrl"]) == (
                "up",
                "",
                server.url,
            )
            assert bad["health"] == "down"
            assert "401" in bad["lastError"], bad["lastError"]
            query = urllib.parse.urlencode({"query": 'up{job="hostpool"}'})

            def up() -> list[str] | None:
                with urllib.request.urlopen(f"{base}/api/v1/query?{query}", timeout=10) as r:
                    result = json.loads(r.read())["data"]["result"]
                return [sample["value"][1] for sample in result] or None

            assert waiting.wait_for(up, "up{job=hostpool}", alive=prom, interval=0.5) == ["1"]
    finally:
        stop(server)
