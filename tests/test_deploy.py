"""deploy/ and the operator commands of docs/operations.md (issue 18, point 9): the Grafana
provisioning, the systemd unit and the example config agree with the repository, and
the page's Prometheus command keeps its data local and its port on loopback."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from hostpool.cli.exitcodes import INVALID
from tests import waiting

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "hostpool-serve.service"


def _installs() -> dict[str, str]:
    """The operations page's `install -D -m MODE SRC DST` lines: SRC -> DST."""
    return dict(re.findall(r"install -D -m \d+ (\S+) (\S+)", OPERATIONS))


def _dashboard() -> dict[str, object]:
    data: dict[str, object] = json.loads((ROOT / "dashboards" / "hostpool.json").read_text())
    return data


def test_every_installed_file_exists() -> None:
    installs = _installs()
    assert len(installs) == 5
    for src in installs:
        assert (ROOT / src).is_file(), src


def test_grafana_provisioning_matches_the_dashboard() -> None:
    sources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/hostpool.yaml").read_text()
    )
    providers = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/hostpool.yaml").read_text()
    )
    assert sources["apiVersion"] == 1 and providers["apiVersion"] == 1
    (source,) = sources["datasources"]
    (provider,) = providers["providers"]
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}  # type: ignore[index]
    # The dashboard picks its data source by type: the provisioned one must be that type.
    assert source["type"] == variables["datasource"]["query"] == "prometheus"
    # ...and where the operations page's Prometheus listens.
    listen = re.search(r"--web.listen-address=(\S+)", _prometheus_command()).group(1)  # type: ignore[union-attr]
    assert source["url"] == f"http://{listen}"
    # The provider loads the directory the operations page installs dashboards/hostpool.json into.
    dest = Path(_installs()["dashboards/hostpool.json"])
    assert provider["type"] == "file" and provider["options"]["path"] == str(dest.parent)
    assert dashboard["uid"] == "hostpool-overview"
    for kind, src in (("datasources", "datasources"), ("dashboards", "dashboards")):
        path = f"deploy/grafana/provisioning/{src}/hostpool.yaml"
        assert _installs()[path] == f"/etc/grafana/provisioning/{kind}/hostpool.yaml"


def _unit_paths() -> tuple[str, str]:
    text = UNIT.read_text()
    start = re.search(r"^ExecStart=(\S+) .*--config (\S+)$", text, re.M)
    assert start is not None
    return start.group(1), start.group(2)


def test_systemd_unit_uses_the_installed_config_and_retries_only_what_can_pass() -> None:
    text = UNIT.read_text()
    binary, config = _unit_paths()
    assert _installs()["deploy/hostpool/serve.toml"] == config
    # the operations page's "Running as a service" makes the venv the unit runs
    assert f"python3 -m venv {Path(binary).parents[1]}\n" in OPERATIONS
    assert _installs()[f"deploy/systemd/{UNIT.name}"] == f"/etc/systemd/system/{UNIT.name}"
    # serve checks before it allocates; an ExecStartPre check would escape
    # RestartPreventExitStatus (it applies to the main process only): a wrong config retried
    assert "ExecStartPre=" not in text
    assert re.findall(r"^RestartPreventExitStatus=(.*)$", text, re.M) == [str(INVALID)]
    assert "Restart=on-failure" in text
    assert "KillSignal=SIGTERM" in text and "RuntimeDirectory=hostpool" in text
    server: dict[str, str] = _serve_config()["server"]  # type: ignore[assignment]
    assert server["share_socket"].startswith("/run/hostpool/")  # the unit's RuntimeDirectory


def _serve_config() -> dict[str, object]:
    import tomllib

    return tomllib.loads((DEPLOY / "hostpool" / "serve.toml").read_text())


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    binary, config = _unit_paths()
    venv = str(Path(binary).parents[1])
    unit = tmp_path / UNIT.name  # installed paths pointed at this checkout
    unit.write_text(
        UNIT.read_text()
        .replace(venv, str(Path(sys.executable).parents[1]))
        .replace(config, str(DEPLOY / "hostpool" / "serve.toml"))
    )
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


def test_example_config_passes_serve_check() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hostpool", "serve", "--check", "--port", "0", "--config",
         str(DEPLOY / "hostpool" / "serve.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: 2 pools")


def _prometheus_command() -> str:
    commands = re.findall(r"^prometheus --config.file=\S+.*$", OPERATIONS, re.M)
    assert len(commands) == 1, commands
    return str(commands[0])


def test_readme_prometheus_command_is_local_and_loopback() -> None:
    command = _prometheus_command()
    tsdb = re.search(r"--storage.tsdb.path=(\S+)", command)
    assert tsdb is not None and not tsdb.group(1).startswith("/")
    assert re.search(r"--web.listen-address=127\.0\.0\.1:\d+", command)


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
def test_readme_prometheus_command_runs(tmp_path: Path) -> None:
    """The operations page's command, from a copy of the repository's metrics/ (another port)."""
    shutil.copytree(ROOT / "metrics", tmp_path / "metrics")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = _prometheus_command().replace("127.0.0.1:9090", f"127.0.0.1:{port}").split()
    with open(tmp_path / "prometheus.log", "w") as log:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=log, stderr=log)
    try:

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=30) as r:
                    return bool(r.status == 200)
            except OSError:
                return False  # not listening yet

        waiting.wait_for(ready, "prometheus ready", alive=proc, interval=0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as r:
            assert len(json.loads(r.read())["data"]["groups"]) >= 2  # both rule files
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert (tmp_path / ".prometheus-data").is_dir()  # its data stayed where it was run


def test_architecture_page_names_every_module_and_the_readme_links_it() -> None:
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert "](docs/ARCHITECTURE.md)" in README
    package = ROOT / "hostpool"
    for path in sorted(package.iterdir()):
        name = path.stem if path.suffix == ".py" else path.name
        if name.startswith("__") or path.suffix not in (".py", "") or not path.exists():
            continue
        if path.is_dir() and not (path / "__init__.py").exists():
            continue
        assert f"`{name}" in page, f"docs/ARCHITECTURE.md does not name hostpool/{path.name}"
