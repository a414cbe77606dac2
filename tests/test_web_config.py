"""TLS and basic auth on hostpool's listeners, from a node_exporter-style web config file.

Real certificates (made with the openssl CLI), real `hostpool serve` and `hostpool
exporter` processes, real TLS clients (Python's ssl and curl), real sockets.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import re
import socket
import ssl
import subprocess
import textwrap
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from hostpool.errors import ConfigError
from hostpool.net import webconfig
from hostpool.net.basicauth import BasicAuth, credentials_of
from hostpool.net.listener import Listener, bind
from tests import helpers, tlspki, waiting

PASSWORD = "s3cret pass:word"  # a colon and a space: only the first colon splits
# cost 4, bcrypt's least: the tests check behaviour, not bcrypt's cost
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test PKI of tests.tlspki, made once for the module."""
    return tlspki.make(tmp_path_factory.mktemp("pki"))


def write_config(directory: Path, text: str, name: str = "web.yml") -> str:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return str(path)


MTLS_AUTH = f"""
    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12
    basic_auth_users:
      alice: {HASH}
"""
TLS_AUTH = f"""
    tls_server_config:
      cert_file: server.crt
      key_file: server.key
    basic_auth_users:
      alice: {HASH}
"""


def client_context(pki: Path, cert: str | None = None) -> ssl.SSLContext:
    """A client trusting only the test CA, checking the host name, with `cert` if given."""
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert is not None:
        context.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
    return context


def auth_header(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def get(url: str, context: ssl.SSLContext, headers: dict[str, str] | None = None) -> Any:
    """(status, headers, body) of GET `url` over TLS."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPSConnection(
        parts.hostname or "", parts.port, context=context, timeout=waiting.DEADLINE
    )
    try:
        conn.request("GET", parts.path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read().decode()  # any case
    finally:
        conn.close()


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str  # of /metrics
    log: str

    @property
    def port(self) -> int:
        port = urllib.parse.urlsplit(self.url).port
        assert port is not None
        return port


def start(tmp_path: Path, *args: str) -> Server:
    """`hostpool ARGS --port 0`, once it logged the https URL of its /metrics."""
    log = str(tmp_path / f"{args[0]}.err")
    proc, url = helpers.start_hostpool(
        log, *args, "--port", "0", url=r'"url": "(https://127\.0\.0\.1:\d+/metrics)"'
    )
    return Server(proc, url, log)


def stop(server: Server) -> None:
    server.proc.terminate()
    assert server.proc.wait(timeout=60) == 0, waiting.log_text(server.log)


@pytest.fixture(scope="module")
def served(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`hostpool serve` with mutual TLS and basic auth."""
    config = write_config(pki, MTLS_AUTH, "mtls.yml")
    server = start(
        tmp_path_factory.mktemp("serve"), "serve", "--pool", "kv=4MiB", "--web-config-file", config
    )
    yield server
    stop(server)


def socket_fds(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:
            continue  # closed while listed
    return count


def refused(attempt: Callable[[], object]) -> BaseException:
    """What `attempt` raised: it must fail without an HTTP response."""
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)) as info:
        attempt()
    return info.value


# ---- the running server --------------------------------------------------------------------


def test_mutual_tls_and_the_right_password_get_metrics(served: Server, pki: Path) -> None:
    status, _, body = get(served.url, client_context(pki, "client"), auth_header("alice", PASSWORD))
    assert status == 200, body
    assert 'hostpool_allocated_bytes{allocator="shm",page_size="4KiB",pool="kv"} 4.194304e+06' in (
        body
    )


def test_curl_verifies_the_chain_and_gets_metrics(served: Server, pki: Path) -> None:
    result = subprocess.run(
        ["curl", "-sS", "--fail", "--cacert", "ca.crt", "--cert", "client.crt",
         "--key", "client.key", "--user", f"alice:{PASSWORD}", served.url],
        cwd=pki, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "hostpool_allocated_bytes{" in result.stdout


def test_wrong_or_missing_password_is_401_with_a_basic_challenge(served: Server, pki: Path) -> None:
    context = client_context(pki, "client")
    for headers in (
        {},
        auth_header("alice", "wrong"),
        {"Authorization": "Bearer abc"},
        {"Authorization": "Basic not-base64!"},
    ):
        status, got, body = get(served.url, context, headers)
        assert status == 401, (headers, body)
        assert got["WWW-Authenticate"] == 'Basic realm="hostpool"'
        assert "hostpool_" not in body
    # more wrong passwords right after one: refused, checked or not (this address waits)
    for headers in (auth_header("alice", PASSWORD + "x"), auth_header("bob", PASSWORD)):
        status, got, body = get(served.url, context, headers)
        assert status in (401, 429, 503), (headers, body)
        assert got["WWW-Authenticate" if status == 401 else "Retry-After"], got
        assert "hostpool_" not in body
    # every endpoint is behind it, not only /metrics
    for path in ("/debug/pools", "/healthz", "/"):
        status, _, _ = get(served.url.replace("/metrics", path), context)
        assert status == 401, path


def test_plain_http_to_the_tls_port_gets_no_answer(served: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=waiting.DEADLINE)

    def plain_get() -> object:
        conn.request("GET", "/metrics")
        return conn.getresponse()

    try:
        refused(plain_get)
    finally:
        conn.close()


def test_client_without_a_certificate_or_with_another_cas_is_refused(
    served: Server, pki: Path
) -> None:
    headers = auth_header("alice", PASSWORD)
    for cert in (None, "rogue"):
        context = client_context(pki, cert)

        def attempt(context: ssl.SSLContext = context) -> object:
            return get(served.url, context, headers)

        refused(attempt)


def test_a_client_that_trusts_another_ca_refuses_the_server(served: Server, pki: Path) -> None:
    context = ssl.create_default_context(cafile=str(pki / "other-ca.crt"))
    context.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
    with pytest.raises(ssl.SSLCertVerificationError):
        get(served.url, context, auth_header("alice", PASSWORD))


def test_stalled_handshakes_do_not_block_others_and_meet_the_deadline(
    served: Server, pki: Path
) -> None:
    """Clients that connect and never send a ClientHello, or stop in the middle of one:
    a scrape is still answered, and they are closed by the request deadline."""
    stalled = []
    for partial in (b"", b"", b"\x16\x03\x01\x02\x00"):  # a record header, no body
        sock = socket.create_connection(("127.0.0.1", served.port), timeout=waiting.DEADLINE)
        sock.sendall(partial)
        stalled.append(sock)
    try:
        status, _, _ = get(
            served.url, client_context(pki, "client"), auth_header("alice", PASSWORD)
        )
        assert status == 200
        for sock in stalled:  # the server closes them: EOF (or a reset), never a timeout
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
    finally:
        for sock in stalled:
            sock.close()
    waiting.wait_for_log(served.log, "tls_handshake_timeout", alive=served.proc)


def test_refused_handshakes_leak_no_fd(served: Server, pki: Path) -> None:
    before = socket_fds(served.proc.pid)
    no_cert = client_context(pki)
    for _ in range(50):
        refused(lambda: get(served.url, no_cert, auth_header("alice", PASSWORD)))
    waiting.wait_for(
        lambda: socket_fds(served.proc.pid) == before,
        f"serve's sockets back to {before} after 50 refused handshakes",
        alive=served.proc,
    )
    status, _, _ = get(served.url, client_context(pki, "client"), auth_header("alice", PASSWORD))
    assert status == 200  # and it still serves


def test_exporter_serves_tls_with_basic_auth(served: Server, pki: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, TLS_AUTH.replace("server.", str(pki / "server.")))
    exporter = start(
        tmp_path, "exporter", "--pid", str(served.proc.pid), "--web.config.file", config
    )
    try:
        context = client_context(pki)  # NoClientCert: none needed
        status, _, body = get(exporter.url, context, auth_header("alice", PASSWORD))
        assert status == 200, body
        assert re.search(r"^hostpool_exporter_target_up(\{[^}]*\})? 1\.0$", body, re.M), body
        status, _, _ = get(exporter.url, context, auth_header("alice", "nope"))
        assert status == 401
    finally:
        stop(exporter)


# ---- config errors: one line, exit 2, before anything is allocated ---------------------------


@pytest.mark.parametrize("command", ["serve --pool kv=4MiB", "serve --check", "exporter --pid 1"])
def test_a_wrong_web_config_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    config = write_config(tmp_path, "tls_server_config:\n  cert_file: missing.crt\n")
    result = helpers.hostpool(*command.split(), "--port", "0", "--web-config-file", config)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "tls_server_config.key_file is required" in lines[0]
    assert config in lines[0]


def test_serve_check_names_tls_and_auth(pki: Path) -> None:
    config = write_config(pki, MTLS_AUTH, "check.yml")
    result = helpers.hostpool("serve", "--pool", "kv=4MiB", "--port", "0", "--check",
                              "--web-config-file", config)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("TLS (RequireAndVerifyClientCert), basic auth (1 user)")


def test_toml_web_config_file_is_relative_to_the_toml(pki: Path, tmp_path: Path) -> None:
    from hostpool.serve import config as serve_config

    (tmp_path / "conf").mkdir()
    write_config(tmp_path / "conf", TLS_AUTH.replace("server.", str(pki / "server.")))
    toml = tmp_path / "conf" / "serve.toml"
    toml.write_text('[server]\nweb_config_file = "web.yml"\n[pools.kv]\nsize = "4MiB"\n')
    cfg = serve_config.from_file(str(toml))
    assert cfg.web is not None and cfg.web.scheme == "https"
    assert cfg.web.users == {"alice": HASH.encode()}


# ---- the file's checks ---------------------------------------------------------------------


def test_relative_paths_resolve_against_the_config_directory(
    pki: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # not the config's directory
    web = webconfig.load(write_config(pki, MTLS_AUTH, "relative.yml"))
    assert web.tls is not None and web.tls.verify_mode == ssl.CERT_REQUIRED
    assert web.tls.minimum_version == ssl.TLSVersion.TLSv1_2
    assert web.client_auth == "RequireAndVerifyClientCert"
    assert web.describe() == "TLS (RequireAndVerifyClientCert), basic auth (1 user)"


def test_empty_file_is_plain_http_and_auth_only_is_allowed(tmp_path: Path) -> None:
    assert webconfig.load(write_config(tmp_path, "")).describe() == "plain HTTP"
    web = webconfig.load(write_config(tmp_path, f"basic_auth_users:\n  bob: '{HASH}'\n"))
    assert (web.tls, web.scheme, web.describe()) == (
        None,
        "http",
        "plain HTTP, basic auth (1 user)",
    )


TLS = "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
BAD_CONFIGS = [
    ("tls_server_config: [1]\n", "tls_server_config must be a mapping"),
    ("tls_config:\n  cert_file: x\n", "unknown key 'tls_config'"),
    (TLS + "  certfile: x\n", "unknown key 'tls_server_config.certfile'"),
    ("tls_server_config:\n  key_file: server.key\n", "tls_server_config.cert_file is required"),
    (TLS.replace("server.key", "nope.key"), "tls_server_config.key_file"),
    (TLS.replace("server.key", "."), "tls_server_config.key_file"),
    (TLS.replace("server.crt", "server.key"), "tls_server_config.cert_file"),
    (TLS.replace("server.key", "client.key"), "tls_server_config.key_file"),
    (TLS + "  client_auth_type: Sometimes\n", "tls_server_config.client_auth_type 'Sometimes'"),
    (TLS + "  client_auth_type: RequireAnyClientCert\n", "RequireAnyClientCert is not supported"),
    (TLS + "  client_auth_type: VerifyClientCertIfGiven\n", "needs client_ca_file"),
    (TLS + "  client_ca_file: ca.crt\n", "client_ca_file is set but client_auth_type"),
    (TLS + "  min_version: TLS14\n", "tls_server_config.min_version 'TLS14'"),
    (TLS + "  min_version: TLS13\n  max_version: TLS12\n", "max_version TLS12 is below"),
    (TLS + "  cipher_suites: [x]\n", "tls_server_config.cipher_suites is not supported"),
    ("http_server_config:\n  http2: false\n", "http_server_config is not supported"),
    ("basic_auth_users:\n  alice: secret\n", "basic_auth_users.alice is not a bcrypt hash"),
    ("basic_auth_users:\n  alice: 12\n", "basic_auth_users.alice is not a bcrypt hash"),
    (f"basic_auth_users:\n  alice: '{HASH[:4]}03{HASH[6:]}'\n", "cost must be 04..31"),
    (f"basic_auth_users:\n  'a:b': '{HASH}'\n", "without ':'"),
    ("basic_auth_users: [alice]\n", "basic_auth_users must be a mapping"),
    ("a: [\n", "not YAML"),
    ("- 1\n", "the file must be a mapping"),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_bad_config_is_a_config_error_naming_key_and_file(
    pki: Path, text: str, message: str
) -> None:
    path = write_config(pki, text, "bad.yml")
    with pytest.raises(ConfigError) as info:
        webconfig.load(path)
    assert message in str(info.value)
    assert path in str(info.value)


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        webconfig.load(str(tmp_path / "absent.yml"))


# ---- basic auth ----------------------------------------------------------------------------


def ok_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"in\n"]


def test_a_success_and_a_failure_are_cached() -> None:
    auth = BasicAuth({"alice": HASH.encode()}, ok_app)
    assert auth.check("alice", PASSWORD) and auth.bcrypt_rounds == 1
    assert auth.check("alice", PASSWORD) and auth.bcrypt_rounds == 1  # from the cache
    assert not auth.check("alice", "wrong") and auth.bcrypt_rounds == 2
    assert not auth.check("alice", "wrong") and auth.bcrypt_rounds == 2  # from the cache
    assert auth.check("alice", PASSWORD) and auth.bcrypt_rounds == 2  # still remembered


def test_an_unknown_user_costs_a_decoy_round() -> None:
    auth = BasicAuth({"alice": HASH.encode()}, ok_app)
    assert not auth.check("mallory", PASSWORD) and auth.bcrypt_rounds == 1


def test_an_expired_success_is_checked_again() -> None:
    auth = BasicAuth({"alice": HASH.encode()}, ok_app, ttl=0.0)
    assert auth.check("alice", PASSWORD) and auth.check("alice", PASSWORD)
    assert auth.bcrypt_rounds == 2


def test_the_cache_is_bounded() -> None:
    users = {f"u{i}": bcrypt.hashpw(b"pw", bcrypt.gensalt(4)) for i in range(5)}
    auth = BasicAuth(users, ok_app, cache_size=3)
    for name in users:
        assert auth.check(name, "pw")
    assert auth.bcrypt_rounds == 5
    assert auth.check("u4", "pw") and auth.bcrypt_rounds == 5  # recent: kept
    assert auth.check("u0", "pw") and auth.bcrypt_rounds == 6  # oldest: dropped


def test_credentials_of() -> None:
    assert credentials_of(auth_header("alice", "a:b")["Authorization"]) == ("alice", "a:b")
    assert credentials_of("basic " + base64.b64encode(b"u:").decode()) == ("u", "")
    assert credentials_of("Basic " + base64.b64encode(b"no colon").decode()) is None
    assert credentials_of("Basic " + base64.b64encode(b"\xff:x").decode()) is None
    assert credentials_of("Basic %%%") is None
    assert credentials_of("") is None


# ---- the listener in-process: a stalled handshake cannot freeze the loop ---------------------


@pytest.fixture
def tls_listener(pki: Path) -> Iterator[Listener]:
    """A TLS listener whose request deadline is far away: only non-blocking handshakes
    let another client through while stalled ones are open (a handshake blocking on the
    loop would wait for the rest of a cut ClientHello, and no other client would be
    served)."""
    web = webconfig.load(write_config(pki, TLS_AUTH, "inproc.yml"))
    listener = Listener(
        bind("127.0.0.1", 0), web_config=web, request_timeout=600.0, connection_limit=64
    )
    listener.serve(ok_app)
    yield listener
    listener.stop()


def test_stalled_clients_stay_open_while_another_is_served(
    tls_listener: Listener, pki: Path
) -> None:
    stalled = [socket.create_connection(tls_listener.address) for _ in range(20)]
    half = socket.create_connection(tls_listener.address)
    half.sendall(b"\x16\x03\x01\x02\x00\x01")  # a ClientHello cut after its first byte
    try:
        for _ in range(3):
            status, _, body = get(
                tls_listener.url("/"), client_context(pki), auth_header("alice", PASSWORD)
            )
            assert (status, body) == (200, "in\n")
        for sock in [*stalled, half]:  # still open: nothing closed them
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
        assert "tls_handshake_timeout" not in tls_listener.closed_connections
    finally:
        for sock in [*stalled, half]:
            sock.close()


def test_large_response_over_tls_arrives_whole(pki: Path) -> None:
    """Bodies above waitress's send threshold are sent by its worker threads as well as
    its loop: one TLS connection, both senders, every byte in order."""
    payload = os.urandom(3 << 20)

    def big(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        start_response("200 OK", [("Content-Length", str(len(payload)))])
        return [payload[i : i + 65536] for i in range(0, len(payload), 65536)]

    web = webconfig.load(write_config(pki, TLS, "big.yml"))
    listener = Listener(bind("127.0.0.1", 0), web_config=web).serve(big)
    try:
        parts = urllib.parse.urlsplit(listener.url("/"))
        conn = http.client.HTTPSConnection(
            "127.0.0.1", parts.port, context=client_context(pki), timeout=waiting.DEADLINE
        )
        for _ in range(2):  # keep-alive: a second request on the same TLS session
            conn.request("GET", "/")
            response = conn.getresponse()
            assert response.status == 200
            assert response.read() == payload
        conn.close()
    finally:
        listener.stop()


def test_handshake_deadline_closes_a_silent_client(pki: Path) -> None:
    web = webconfig.load(write_config(pki, TLS, "deadline.yml"))
    listener = Listener(bind("127.0.0.1", 0), web_config=web, request_timeout=0.2)
    listener.serve(ok_app)
    try:
        sock = socket.create_connection(listener.address, timeout=waiting.DEADLINE)
        assert sock.recv(1) == b""  # closed by the server
        sock.close()
        waiting.wait_for(
            lambda: listener.closed_connections.get("tls_handshake_timeout"),
            "tls_handshake_timeout counted",
        )
    finally:
        listener.stop()
