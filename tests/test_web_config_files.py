"""Odd files as the web config or its certificates (issue 36, point 8).

Through the real CLI, `hostpool exporter` and `hostpool serve` with `--web-config-file`,
as subprocesses with a deadline and an address-space limit: a YAML nested without end or
made of aliases, /dev/zero, a FIFO as the config or as cert_file/key_file, a file over
the size cap, a directory, a config or certificate others may write, a key others may
read. Each is one line on stderr naming the file, exit 2, and never a traceback, a hang
(the deadline) or a read without end (the limit).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hostpool.net import webconfig
from tests import tlspki

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE = 60.0  # seconds: generous; a FIFO opened the blocking way would wait forever
ADDRESS_SPACE = 2 << 30  # bytes: reading /dev/zero to its end would pass it
COMMANDS = {
    "exporter": ["exporter", "--pid", "1"],
    "serve": ["serve", "--pool", "kv=4MiB"],
}
TLS = "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tlspki.make(tmp_path_factory.mktemp("pki"))


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def hostpool(command: str, config: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hostpool", *COMMANDS[command], "--port", "0",
         "--web-config-file", config],
        cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=DEADLINE, preexec_fn=_limit,
    )  # fmt: skip


def tls_dir(pki: Path, where: Path) -> Path:
    """A copy of the server's certificate, key and CA in `where` (modes kept: key 0600)."""
    for name in ("server.crt", "server.key", "ca.crt"):
        shutil.copy(pki / name, where / name)
    return where


def deep(where: Path, pki: Path) -> str:
    (where / "web.yml").write_text("basic_auth_users: " + "[" * 50_000 + "\n")
    return "nested deeper than"


def aliases(where: Path, pki: Path) -> str:
    """A billion laughs: nine aliases of nine aliases... of a list."""
    lines = ['lol: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"lol{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    (where / "web.yml").write_text("\n".join(lines) + "\n")
    return "aliases (*name) are not allowed"


def dev_zero(where: Path, pki: Path) -> str:
    (where / "web.yml").symlink_to("/dev/zero")
    return "is not a regular file: it is a character device"


def fifo(where: Path, pki: Path) -> str:
    os.mkfifo(where / "web.yml")
    return "is not a regular file: it is a FIFO"


def directory(where: Path, pki: Path) -> str:
    (where / "web.yml").mkdir()
    return "is not a regular file: it is a directory"


def too_big(where: Path, pki: Path) -> str:
    (where / "web.yml").write_text("#" * webconfig.MAX_BYTES + "\n")
    return f"more than the {webconfig.MAX_BYTES} it may have"


def fifo_cert(where: Path, pki: Path) -> str:
    tls_dir(pki, where)
    (where / "server.crt").unlink()
    os.mkfifo(where / "server.crt")
    (where / "web.yml").write_text(TLS)
    return "tls_server_config.cert_file"


def fifo_key(where: Path, pki: Path) -> str:
    tls_dir(pki, where)
    (where / "server.key").unlink()
    os.mkfifo(where / "server.key", 0o600)
    (where / "web.yml").write_text(TLS)
    return "tls_server_config.key_file"


def writable_config(where: Path, pki: Path) -> str:
    (where / "web.yml").write_text("")
    os.chmod(where / "web.yml", 0o666)
    return "is writable by others (mode 0666)"


def readable_key(where: Path, pki: Path) -> str:
    tls_dir(pki, where)
    os.chmod(where / "server.key", 0o644)
    (where / "web.yml").write_text(TLS)
    return "tls_server_config.key_file"


def writable_client_ca(where: Path, pki: Path) -> str:
    tls_dir(pki, where)
    os.chmod(where / "ca.crt", 0o646)
    (where / "web.yml").write_text(
        TLS + "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"
    )
    return "tls_server_config.client_ca_file"


CASES: dict[str, Callable[[Path, Path], str]] = {
    "deeply nested YAML": deep,
    "billion laughs": aliases,
    "/dev/zero": dev_zero,
    "a FIFO": fifo,
    "a directory": directory,
    "over the size cap": too_big,
    "a FIFO as cert_file": fifo_cert,
    "a FIFO as key_file": fifo_key,
    "a config others may write": writable_config,
    "a key others may read": readable_key,
    "a client CA others may write": writable_client_ca,
}
SECOND = {  # what the line says besides the key, where the key is not the whole story
    fifo_cert: "it is a FIFO",
    fifo_key: "it is a FIFO",
    readable_key: "is readable by others (mode 0644)",
    writable_client_ca: "is writable by others (mode 0646)",
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_odd_file_is_one_line_and_exit_2(
    pki: Path, tmp_path: Path, command: str, case: str
) -> None:
    make = CASES[case]
    expected = make(tmp_path, pki)
    config = str(tmp_path / "web.yml")
    result = hostpool(command, config)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert config in lines[0] and expected in lines[0], lines[0]
    assert SECOND.get(make, "") in lines[0], lines[0]


def test_a_key_its_group_may_read_is_loaded(pki: Path, tmp_path: Path) -> None:
    """0640, as with Debian's ssl-cert group: only others are refused."""
    tls_dir(pki, tmp_path)
    os.chmod(tmp_path / "server.key", 0o640)
    (tmp_path / "web.yml").write_text(TLS)
    assert webconfig.load(str(tmp_path / "web.yml")).scheme == "https"


def test_tls_loads_the_files_it_checked(
    pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key path swapped for a world-readable copy after its check: TLS still loads
    the file that was checked (by its fd), not what the path names now."""
    import ssl

    tls_dir(pki, tmp_path)
    (tmp_path / "web.yml").write_text(TLS)
    loaded: list[str] = []
    real = ssl.SSLContext.load_cert_chain

    def spy(self: ssl.SSLContext, certfile: str, keyfile: str, **kw: object) -> None:
        loaded.extend((os.readlink(certfile), os.readlink(keyfile)))
        os.replace(tmp_path / "server.crt", tmp_path / "moved.crt")  # the path names nothing
        try:
            real(self, certfile, keyfile, **kw)
        finally:
            os.replace(tmp_path / "moved.crt", tmp_path / "server.crt")

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", spy)
    assert webconfig.load(str(tmp_path / "web.yml")).scheme == "https"
    assert loaded == [str(tmp_path / "server.crt"), str(tmp_path / "server.key")]
