"""Issue 36.12: the CLI details a first-time user found, each through the real command
(or the real parser and files), each failing on the main of before the fix."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from hostpool.cli import build_parser
from hostpool.cli.exitcodes import INVALID, NOT_NOW
from tests.helpers import hostpool

ROOT = Path(__file__).resolve().parents[1]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_flag_of_every_subcommand_has_help() -> None:
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, sub in _subparsers().items()
        for a in sub._actions
        if not a.help and not isinstance(a, argparse._HelpAction)
    ]
    assert missing == []  # once: serve --hugepages, doctor --hugepages, --hugepage-size


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_run_and_inspect_help_end_with_their_own_exit_statuses(command: str) -> None:
    out = hostpool(command, "--help").stdout
    epilog = out.rstrip().rsplit("\n\n", 1)[1]
    assert epilog.startswith("exit status:")
    assert "port in use" not in epilog and "share socket" not in epilog  # serve's causes
    expected = "CMD's own" if command == "run" else "no such process"
    assert expected in " ".join(epilog.split())


def test_exporter_pid_twice_is_a_usage_error() -> None:
    proc = hostpool("exporter", "--pid", "1", "--pid", "2", "--port", "0")
    assert proc.returncode == INVALID
    assert proc.stderr.count("\n") == 1 and "--pid is given twice (1 and 2)" in proc.stderr


@pytest.mark.parametrize(
    ("args", "flag", "key"),
    [
        (["--pool", "kv=abc"], "--pool kv=SIZE", "pools.kv.size"),
        (["--port", "99999"], "--port", "server.port"),
        (["--budget", "1MiB", "--host-budget", "2MiB"], "--budget and --host-budget", "server."),
        (["--budget", "1MiB", "--pool", "kv=2MiB"], "more than --budget 1MiB", "server."),
    ],
)
def test_serve_errors_name_the_flag_not_the_config_key(
    args: list[str], flag: str, key: str
) -> None:
    proc = hostpool("serve", "--check", *args)
    assert proc.returncode == INVALID
    assert flag in proc.stderr and key not in proc.stderr, proc.stderr


def test_serve_config_errors_name_the_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text("[server]\nprot = 9464\n")
    proc = hostpool("serve", "--check", "--config", str(config))
    assert proc.returncode == INVALID
    assert proc.stderr.startswith(f"hostpool serve: {config}: server: unknown key(s) ['prot']")


def test_doctor_need_says_when_it_passes() -> None:
    proc = hostpool("doctor", "--need", "1MiB", "--hugepages", "off")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("OK: 1MiB")


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3")
def test_run_hint_says_how_hostpool_is_installed() -> None:
    system = "/usr/bin/python3"  # has no hostpool hook: this venv's Python has it
    proc = hostpool("run", "--", system, "-c", "pass")
    assert proc.returncode == NOT_NOW, proc.stderr
    assert f"{system} -m pip install -e {ROOT})" in proc.stderr
    assert "pip install hostpool)" not in proc.stderr


def test_exporter_logs_its_stop() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostpool", "--log-format", "json", "exporter", "--port", "0",
         "--match", "hostpool."],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        serving = json.loads(proc.stderr.readline())
        assert serving["event"] == "hostpool.exporter_serving"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    stopped = [json.loads(x) for x in rest.splitlines() if "exporter_stopped" in x]
    assert stopped and stopped[-1]["signal"] == "SIGTERM"
    assert stopped[-1]["url"] == serving["url"]


def test_metrics_readme_names_every_exporter_metric() -> None:
    source = (ROOT / "hostpool" / "metrics" / "exporter.py").read_text()
    names = set(re.findall(r'"(hostpool_exporter_[a-z_]+)"', source))
    assert "hostpool_exporter_scrape_duration_seconds" in names
    readme = (ROOT / "metrics" / "README.md").read_text()
    assert sorted(n for n in names if f"`{n}`" not in readme) == []


def test_inspect_json_times_are_iso_8601_utc() -> None:
    proc = hostpool("inspect", "--self", "--json")
    assert proc.returncode == 0, proc.stderr
    when = json.loads(proc.stdout)["time"]
    assert isinstance(when, str) and when.endswith("Z")
    assert datetime.fromisoformat(when).utcoffset() is not None


def test_example_config_and_unit_agree_on_check() -> None:
    toml = (ROOT / "deploy" / "hostpool" / "serve.toml").read_text()
    unit = (ROOT / "deploy" / "systemd" / "hostpool-serve.service").read_text()
    runs_check = re.search(r"^ExecStartPre=.*serve --check", unit, re.M) is not None
    assert runs_check or "the unit runs that first" not in toml
    assert "does not run that first" in toml


def test_systemd_unit_logs_console_lines_to_the_journal() -> None:
    unit = (ROOT / "deploy" / "systemd" / "hostpool-serve.service").read_text()
    start = re.search(r"^ExecStart=(.*)$", unit, re.M)
    assert start is not None and "--log-format console" in start.group(1)


def test_doctor_hugepages_required_says_when_it_passes_or_why_not() -> None:
    proc = hostpool("doctor", "--hugepages", "required")
    last = proc.stdout.rstrip().splitlines()[-1]
    if proc.returncode == 0:
        assert last.startswith("OK: 2MiB hugepages")
    else:
        assert last.startswith("PROBLEM:")


TINY_HOLDER = """
import os, sys
fd = os.memfd_create(sys.argv[1])
os.write(fd, b"x" * 1000)  # one page resident for 1000 bytes
print("ready", flush=True)
sys.stdin.readline()
"""


def test_shm_never_prints_resident_above_the_size() -> None:
    """Pages are whole: a 1000-byte memfd holds 4 KiB. Its line says 1000B of 1000B;
    --json keeps the pages (resident_bytes 4096)."""
    name = f"vllm_offload_tiny_{os.getpid()}.mmap"
    child = subprocess.Popen(
        [sys.executable, "-c", TINY_HOLDER, name], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        text = hostpool("shm", "--engine", "vllm")
        doc = json.loads(hostpool("shm", "--engine", "vllm", "--json").stdout)
    finally:
        child.kill()
        child.wait()
    assert text.returncode == 0, text.stderr
    (line,) = [ln for ln in text.stdout.splitlines() if name in ln]
    assert line.split()[:4] == ["memfd", "1000B", "of", "1000B"], line
    (obj,) = [o for o in doc["objects"] if o["name"] == name]
    assert (obj["size_bytes"], obj["resident_bytes"]) == (1000, os.sysconf("SC_PAGE_SIZE"))
