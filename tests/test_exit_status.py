"""One exit-status rule for every subcommand (hostpool.cli.exitcodes), run as an operator
runs them: real processes, a real port held by another socket, a real live share socket.

0 ok; 1 the input is right but this host cannot do it now; 2 the input is wrong.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostpool.cli import SUBCOMMANDS
from hostpool.cli.exitcodes import INVALID, NOT_NOW, OK
from tests.helpers import hostpool

ROOT = Path(__file__).resolve().parents[1]
HUGE_2M = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on (as a running service's would be)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


@pytest.fixture
def live_share_socket(tmp_path: Path) -> Iterator[str]:
    """A share-socket path a live server answers at."""
    path = str(tmp_path / "share.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as live:
        live.bind(path)
        live.listen()
        yield path


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


@pytest.mark.parametrize("check", [False, True], ids=["serve", "serve --check"])
def test_a_port_in_use_is_1_for_serve_its_check_and_the_exporter(
    busy_port: int, check: bool
) -> None:
    proc = hostpool("serve", *(["--check"] if check else []), "--port", str(busy_port),
                    "--pool", "kv=1MiB")  # fmt: skip
    assert proc.returncode == NOT_NOW
    line = one_line(proc)
    assert f"cannot listen on 127.0.0.1:{busy_port}: Address already in use" in line
    # --check says how to check the rest beside the running service; serve does not
    assert ("--no-port-check" in line) == check
    exporter = hostpool("exporter", "--match", "hostpool.", "--port", str(busy_port))
    assert exporter.returncode == NOT_NOW
    assert "Address already in use" in one_line(exporter)


@pytest.mark.parametrize("check", [False, True], ids=["serve", "serve --check"])
def test_memory_this_host_lacks_is_1_whether_now_or_ever(check: bool) -> None:
    """More than MemTotal (kv=10TiB) and more than is available now (all of MemTotal:
    MemAvailable is always less) have one cause and one status; pools over the config's
    own budget are a wrong input."""
    flags = ["--check"] if check else []
    never = hostpool("serve", *flags, "--port", "0", "--pool", "kv=10TiB")
    now = hostpool("serve", *flags, "--port", "0", "--pool", f"kv={mem_total() // 1024}KiB")
    assert (never.returncode, now.returncode) == (NOT_NOW, NOT_NOW), (never.stderr, now.stderr)
    assert "MemTotal" in one_line(never) and "MemAvailable" in one_line(now)
    budget = hostpool("serve", *flags, "--port", "0", "--pool", "kv=2MiB", "--budget", "1MiB")
    # named as the flag that set it (issue 36.12), not as the config key server.budget
    assert budget.returncode == INVALID and "more than --budget 1MiB" in one_line(budget)


@pytest.mark.skipif(not HUGE_2M.exists(), reason="no 2 MiB hugepages on this kernel")
def test_too_few_hugepages_reserved_is_1() -> None:
    reserved = int(HUGE_2M.read_text())
    size = (reserved + 1) * 2  # MiB: one page more than the pool holds
    proc = hostpool("serve", "--check", "--port", "0", "--pool", f"kv={size}MiB",
                    "--hugepages", "required")  # fmt: skip
    assert proc.returncode == NOT_NOW, proc.stderr
    assert "nr_hugepages" in one_line(proc)


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--check", "--pool", "kv=4potatoes"],
        ["serve", "--check", "--config", "/nonexistent/hostpool/serve.toml"],
        ["serve", "--check", "--port", "99999"],
        ["serve", "--bogus"],
        ["exporter", "--match", "x", "--bogus"],
        ["inspect", "--bogus"],
        ["doctor", "--need", "lots"],
        [
            "doctor",
            "--kubernetes",
            "--container",
            "vllm",
            "--engine-memory",
            "48",
            "--",
            "vllm",
            "serve",
            "m",
            "--kv-offloading-size",
            "1",
        ],  # no unit: did you mean 48GiB?
        ["doctor", "--kubernetes", "--", "vllm", "serve", "m", "--kv-offloading-size", "1"],
        ["reap", "--y"],  # no abbreviation of --yes
        ["shm", "--jsn"],
        ["run", "--only", "nosuchserver", "--", "true"],
        ["serve", "--no-port-check"],  # goes with --check only
    ],
)
def test_wrong_input_is_2_in_every_subcommand(args: list[str]) -> None:
    proc = hostpool(*args)
    assert proc.returncode == INVALID, proc.stderr
    one_line(proc)


def test_a_malformed_config_is_2(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text("[pools.kv]\nsize = \n")
    proc = hostpool("serve", "--check", "--config", str(config))
    assert proc.returncode == INVALID and "malformed" in one_line(proc)


def test_a_live_server_at_the_share_socket_is_1(live_share_socket: str) -> None:
    proc = hostpool("serve", "--check", "--port", "0", "--pool", "kv=1MiB",
                    "--share-socket", live_share_socket)  # fmt: skip
    assert proc.returncode == NOT_NOW
    line = one_line(proc)
    assert "already listening" in line and "--no-port-check" in line


def test_check_beside_a_running_service_checks_the_rest_and_says_so(
    busy_port: int, live_share_socket: str, tmp_path: Path
) -> None:
    """The running service holds the port and the share socket: --no-port-check checks
    everything else, passes, and names what it did not check."""
    args = ["serve", "--check", "--no-port-check", "--port", str(busy_port),
            "--share-socket", live_share_socket]  # fmt: skip
    ok = hostpool(*args, "--pool", "kv=1MiB")
    assert (ok.returncode, ok.stderr) == (OK, ""), ok.stderr
    assert ok.stdout.startswith("ok: 1 pools (kv 1MiB (shm)); ")
    assert f"listen 127.0.0.1:{busy_port} not checked (--no-port-check)" in ok.stdout
    assert f"share socket {live_share_socket} not checked" in ok.stdout
    # ...and the rest is still checked: a wrong config, a host that cannot hold it
    assert hostpool(*args, "--pool", "kv=1potato").returncode == INVALID
    assert hostpool(*args, "--pool", "kv=10TiB").returncode == NOT_NOW
    too_long = str(tmp_path / ("x" * 120))
    bad_path = hostpool("serve", "--check", "--no-port-check", "--port", str(busy_port),
                        "--pool", "kv=1MiB", "--share-socket", too_long)  # fmt: skip
    assert bad_path.returncode == INVALID and "at most 107" in one_line(bad_path)


def test_the_rule_is_in_every_help_and_the_cli_reference() -> None:
    for command in ["", *SUBCOMMANDS]:
        proc = hostpool(*([command] if command else []), "--help")
        assert proc.returncode == OK
        text = " ".join(proc.stdout.split())
        assert "exit status: 0 ok" in text and "2 the input is wrong" in text, command
    reference = (ROOT / "docs" / "cli.md").read_text()
    section = re.search(r"^## Exit status\n(.*?)(?=^#)", reference, re.M | re.S)
    assert section is not None
    for status in (OK, NOT_NOW, INVALID):
        assert f"\n| {status} |" in section.group(1)


def test_every_subcommand_help_has_a_description() -> None:
    """`hostpool X --help`: usage, then a paragraph saying what X does, then the flags."""
    top = hostpool("--help").stdout
    for command in SUBCOMMANDS:
        assert re.search(rf"^    {command}\s+\S", top, re.M), f"{command} not in hostpool --help"
        text = hostpool(command, "--help").stdout
        head = text.split("\n\n")
        # head[0] is the usage block; the description comes before any argument list
        assert len(head) > 2 and not head[1].startswith(("options:", "positional")), text
        assert len(head[1].split()) >= 8, f"{command}: description too thin: {head[1]!r}"
