"""Basic auth is not a CPU lever (issue 36, point 1).

Real listeners on loopback (the one `serve` and `exporter` use) with basic auth in front
of /healthz, real sockets, real bcrypt hashes. Where a bcrypt round must be slow for the
test to mean something, `bcrypt.checkpw` is replaced by one that blocks until the test
lets it go: a flood is then "rounds that never end", and whatever answers meanwhile is
proven not to wait for them. No timing assertions: every wait is on an event or a state.
"""

from __future__ import annotations

import base64
import http.client
import select
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import bcrypt
import pytest
from structlog.testing import capture_logs

from hostpool.net import basicauth
from hostpool.net.basicauth import BasicAuth
from hostpool.net.listener import Listener, bind
from hostpool.net.routes import Route, routed_app, text_app
from hostpool.net.webconfig import WebConfig
from tests import waiting

PASSWORD = "right"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4))  # cost 4: behaviour, not cost
ANSWER_DEADLINE = 60.0  # seconds: generous; a request blocked behind rounds never answers


def header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def request(user: str, password: str, path: str = "/healthz") -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: t\r\nAuthorization: {header(user, password)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()


def get(listener: Listener, password: str, path: str = "/healthz") -> tuple[int, str, str]:
    """(status, Retry-After, body) of GET `path` as alice on a new connection."""
    host, port = listener.address
    conn = http.client.HTTPConnection(host, port, timeout=ANSWER_DEADLINE)
    try:
        conn.request("GET", path, headers={"Authorization": header("alice", password)})
        response = conn.getresponse()
        return response.status, response.getheader("Retry-After", ""), response.read().decode()
    finally:
        conn.close()


def status_of(sock: socket.socket) -> int:
    """The HTTP status a raw socket's request got (the answer read whole)."""
    sock.settimeout(ANSWER_DEADLINE)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return int(data.split(b" ", 2)[1])


def readable(socks: list[socket.socket]) -> list[socket.socket]:
    """The sockets with something to read now."""
    ready, _, _ = select.select(socks, [], [], 0)
    return ready


@pytest.fixture
def listener() -> Iterator[Listener]:
    """`/healthz` behind basic auth for alice, on a listener with waitress's 4 threads."""
    web = WebConfig("test", users={"alice": HASH})
    app = routed_app("t", [Route("/healthz", "liveness", text_app("ok\n"))])
    served = Listener(bind("127.0.0.1", 0), web_config=web, threads=4).serve(app)
    yield served
    served.stop()


class BlockingBcrypt:
    """bcrypt.checkpw that blocks each round until `release` is set; counts rounds."""

    def __init__(self, real: Callable[[bytes, bytes], bool]) -> None:
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.rounds = 0

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.rounds += 1
        self.entered.set()
        assert self.release.wait(ANSWER_DEADLINE)
        return self.real(password, hashed)


@pytest.fixture
def blocking(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockingBcrypt]:
    fake = BlockingBcrypt(bcrypt.checkpw)
    monkeypatch.setattr(bcrypt, "checkpw", fake)
    yield fake
    fake.release.set()


def test_a_password_over_72_bytes_is_401_not_500(listener: Listener) -> None:
    for password in ("x" * 73, "é" * 37, PASSWORD + "y" * 70):  # bytes, not characters
        status, _, body = get(listener, password)
        assert status == 401, body
        assert "Traceback" not in body
    assert get(listener, PASSWORD)[0] == 200  # 5 bytes: checked, right


def test_a_flood_of_wrong_passwords_does_not_starve_healthz(
    listener: Listener, blocking: BlockingBcrypt
) -> None:
    blocking.release.set()
    assert get(listener, PASSWORD)[0] == 200  # alice's success is now remembered
    blocking.release.clear()
    blocking.entered.clear()
    blocking.rounds = 0
    flood = []
    try:
        for i in range(16):  # each a new wrong password: no remembered verdict answers it
            sock = socket.create_connection(listener.address)
            sock.sendall(request("alice", f"wrong-{i}"))
            flood.append(sock)
        assert blocking.entered.wait(ANSWER_DEADLINE)  # a round runs, and never ends yet

        # all but two (the round, and one waiting for it) are answered meanwhile
        def all_but_two() -> list[socket.socket] | None:
            ready = readable(flood)
            return ready if len(ready) == len(flood) - 2 else None

        answered = waiting.wait_for(all_but_two, "answers to the flood while its round runs")
        assert [status_of(sock) for sock in answered] == [503] * len(answered)
        # answered while the round still runs: neither waits for it
        assert get(listener, PASSWORD)[0] == 200
        status, retry, _ = get(listener, "another wrong one")
        assert status == 503 and int(retry) >= 1
        assert blocking.rounds == 1 and not blocking.release.is_set()
        blocking.release.set()
        assert {status_of(sock) for sock in flood if sock not in answered} <= {401, 429, 503}
    finally:
        blocking.release.set()
        for sock in flood:
            sock.close()


def test_no_round_runs_for_a_client_that_has_gone(blocking: BlockingBcrypt) -> None:
    auth = BasicAuth({"alice": HASH}, text_app("in\n"), checking=2)
    listener = Listener(bind("127.0.0.1", 0), threads=4).serve(auth)
    try:
        first = socket.create_connection(listener.address)
        first.sendall(request("alice", "wrong-1"))
        assert blocking.entered.wait(ANSWER_DEADLINE)
        second = socket.create_connection(listener.address, source_address=("127.0.0.2", 0))
        second.sendall(request("alice", "wrong-2"))
        waiting.wait_for(lambda: auth.in_check == 2, "the second request waiting for the round")
        second.close()  # gone before its round
        blocking.release.set()
        assert status_of(first) == 401
        waiting.wait_for(lambda: auth.in_check == 0, "both requests done")
        assert (blocking.rounds, auth.bcrypt_rounds, auth.gone) == (1, 1, 1)
        first.close()
    finally:
        blocking.release.set()
        listener.stop()


def test_failed_logins_are_logged_with_their_count_when_no_failure_follows() -> None:
    auth = BasicAuth({"alice": HASH}, text_app("in\n"), log_interval=1.0)
    environ = {"HTTP_AUTHORIZATION": header("alice", "wrong"), "REMOTE_ADDR": "127.0.0.9"}
    statuses: list[str] = []
    with capture_logs() as logs:
        for _ in range(3):  # the first is checked; the others remembered as wrong
            auth(dict(environ), lambda status, headers: statuses.append(status))
        assert statuses == ["401 Unauthorized"] * 3

        def told() -> list[dict[str, Any]] | None:
            got = [e for e in logs if e["event"] == "hostpool.http_unauthorized"]
            return got if sum(e["count"] for e in got) == 3 else None

        # the held-back ones come with their count although no fourth failure follows
        got = waiting.wait_for(told, "the held-back failures, flushed by the timer")
    assert len(got) >= 2 and got[0]["count"] == 1
    assert all((e["why"], e["client"]) == (basicauth.WRONG, "127.0.0.9") for e in got)


def ok(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("200 OK", [])
    return [b"in"]


def test_a_failure_is_remembered_and_the_address_backs_off() -> None:
    auth = BasicAuth({"alice": HASH}, ok)
    wrong = basicauth.WRONG
    assert auth.verdict("alice", "wrong") == wrong and auth.bcrypt_rounds == 1
    assert auth.verdict("alice", "wrong") == wrong and auth.bcrypt_rounds == 1  # remembered
    assert auth.verdict("alice", "wrong", client="10.0.0.1") == wrong  # from any address
    assert auth.bcrypt_rounds == 1
    # another wrong password right after a failed round: no round, whatever the address
    assert auth.verdict("alice", "wrong 2", client="10.0.0.2") == basicauth.BUSY
    assert auth.bcrypt_rounds == 1


def test_a_wrong_password_makes_its_address_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(basicauth, "FAILED_SHARE", 1.0)  # no global rest: the address's own
    auth = BasicAuth({"alice": HASH}, ok)
    for strike in range(basicauth.FREE_STRIKES):  # the first wrong ones cost no wait
        assert auth.verdict("alice", f"wrong {strike}", client="10.0.0.1") == basicauth.WRONG
    assert auth.verdict("alice", "wrong", client="10.0.0.1") == basicauth.WRONG
    assert auth.verdict("alice", "wrong 2", client="10.0.0.1") == basicauth.BACKING_OFF
    assert auth.retry_after("10.0.0.1") >= 1
    assert auth.verdict("alice", "wrong 2", client="10.0.0.2") == basicauth.WRONG  # another address
    assert auth.verdict("alice", PASSWORD, client="10.0.0.3") == "allow"
    # a remembered success answers an address that is waiting
    assert auth.verdict("alice", PASSWORD, client="10.0.0.1") == "allow"
    assert auth.bcrypt_rounds == 3 + basicauth.FREE_STRIKES


def test_a_stale_password_beside_a_good_one_never_holds_the_good_one_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One Prometheus, two jobs on one target: one with a stale password. Its repeats are
    remembered failures (no strike), so the good job's first round runs from the same
    address, whatever order they come in."""
    monkeypatch.setattr(basicauth, "FAILED_SHARE", 1.0)  # no global rest: the address's own
    auth = BasicAuth({"alice": HASH}, ok)
    for _ in range(5):
        assert auth.verdict("alice", "stale", client="127.0.0.1") == basicauth.WRONG
    assert auth.verdict("alice", PASSWORD, client="127.0.0.1") == "allow"
    assert auth.bcrypt_rounds == 2


class Clock:
    """Monotonic seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_success_outlives_prometheus_default_interval_while_wrong_passwords_flood() -> None:
    """Issue 43, point 7: a good scraper every 60 s (Prometheus' default), even one that
    missed a scrape (120 s), between wrong passwords from other addresses, never needs a
    round again; a success unused for longer than `ttl` (at least 5 minutes) costs one."""
    clock = Clock()
    auth = BasicAuth({"alice": HASH}, ok, clock=clock)
    assert auth.ttl >= 300
    assert auth.verdict("alice", PASSWORD, client="10.0.0.9") == "allow"
    for minute in range(1, 11):
        assert auth.verdict("alice", f"wrong {minute}", client=f"10.0.1.{minute}") in (
            basicauth.WRONG,
            basicauth.BUSY,
        )
        clock.now += 60.0 * (1 + minute % 2)
        rounds = auth.bcrypt_rounds
        assert auth.verdict("alice", PASSWORD, client="10.0.0.9") == "allow"
        assert auth.bcrypt_rounds == rounds  # remembered: no round, never BUSY
    clock.now += auth.ttl + 1  # unused past its ttl: checked again
    rounds = auth.bcrypt_rounds
    assert auth.verdict("alice", PASSWORD, client="10.0.0.9") == "allow"
    assert auth.bcrypt_rounds == rounds + 1


def test_a_wrong_password_is_forgotten_after_its_own_ttl() -> None:
    clock = Clock()
    auth = BasicAuth({"alice": HASH}, ok, clock=clock, failure_ttl=60.0)
    assert auth.verdict("alice", "wrong") == basicauth.WRONG
    clock.now += 59.0
    assert auth.verdict("alice", "wrong") == basicauth.WRONG and auth.bcrypt_rounds == 1
    clock.now += 10_000.0  # past the rest after the failed round and the failure's ttl
    assert auth.verdict("alice", "wrong") == basicauth.WRONG and auth.bcrypt_rounds == 2
