"""HTTP basic auth in front of a WSGI application, against bcrypt hashes; not a CPU lever.

`BasicAuth(users, app)` answers a request without credentials, or with a user or password
that does not match, with 401 and `WWW-Authenticate: Basic realm="hostpool"`; the
application never runs for it. A password is checked with `bcrypt.checkpw` (constant
time); an unknown user costs one bcrypt round too, so timing does not tell which users
exist. A bcrypt round costs tens to hundreds of milliseconds of CPU on purpose, so a
stream of wrong passwords must not decide how many run:

- verdicts are remembered, keyed by a SHA-256 of (user, password, the user's hash): a
  success for `ttl` seconds after its last use (300 by default, five times Prometheus'
  default scrape interval: a scraper's repeated scrapes cost one round, ever, and a
  flood of wrong passwords that keeps rounds busy never sends a good scraper to the
  503 queue), a failure for `failure_ttl` seconds (a password retried costs nothing);
  the two are kept apart, so failures never push a success out;
- a password over 72 bytes is a 401 without a round (bcrypt reads 72 bytes at most;
  bcrypt 5 refuses longer ones);
- at most one round runs at a time, and at most `checking` requests (the round and those
  waiting for it) hold a listener thread; any other request that needs a round is a 503
  with `Retry-After` at once, so the listener's other threads stay free for /healthz and
  for scrapes whose success is remembered;
- wrong passwords get at most a quarter of one CPU: after a failed round the next one
  waits three times as long as it took (503 meanwhile), however many addresses send;
- an address that keeps sending new wrong passwords waits before its next round: from
  its `FREE_STRIKES + 1`th wrong password in a row, 0.5 s, doubling to 16 s while it
  keeps failing, gone at its first success; meanwhile it gets 429 with `Retry-After`, at
  no cost; remembered verdicts still answer it. The strikes spare the common case of
  one scraper with a stale password beside a good one on the same address (a Prometheus
  job misconfigured next to a right one): a repeated wrong password is a remembered
  failure and no strike, so the good job's first round is never refused for it;
- a request whose client has closed its connection (the environ's
  `hostpool.client_gone`, from the listener) is dropped before its round.

Refused requests are logged as `hostpool.http_unauthorized`, by `why`, at most one line
per reason per `log_interval` seconds, with the `count` of those folded in; what is held
back is logged when the interval has passed even if no request follows.
"""

from __future__ import annotations

import binascii
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hostpool.net.guard import Backoff, Throttle
from hostpool.net.wsgi import WSGIApp

REALM = "hostpool"
# seconds a success is remembered after its last use: longer than any usual scrape
# interval (Prometheus' default is 60 s), so a scraper's success never lapses between
# two scrapes while wrong passwords keep the bcrypt round busy
CACHE_TTL = 300.0
FAILURE_TTL = 60.0  # seconds a wrong password is remembered
CACHE_SIZE = 256  # successes remembered at most
FAILURE_CACHE_SIZE = 4096  # failures remembered at most
BACKOFF_LEAST = 0.5  # seconds an address waits after a wrong password...
BACKOFF_MOST = 16.0  # ...doubling up to this while it keeps failing
BACKOFF_SIZE = 4096  # addresses remembered at most
FREE_STRIKES = 2  # distinct wrong passwords an address may send before it waits
LOG_INTERVAL = 10.0  # seconds between two lines of one reason
BCRYPT_MAX_BYTES = 72  # bcrypt reads no further
FAILED_SHARE = 0.25  # of one CPU, at most, for rounds that find a wrong password

ALLOW = "allow"
NO_CREDENTIALS = "no credentials"
WRONG = "wrong user or password"
TOO_LONG = "password over 72 bytes"
BACKING_OFF = "address backing off after a wrong password"
BUSY = "too many logins being checked"
GONE = "client gone before its check"
_UNAUTHORIZED = b"unauthorized: this endpoint needs basic auth (see the web config file)\n"
# not checked now: a status and body that say so, and Retry-After
_NOT_NOW = {
    BACKING_OFF: ("429 Too Many Requests", b"too many wrong passwords from this address\n"),
    BUSY: ("503 Service Unavailable", b"too many logins being checked\n"),
}


def _never() -> bool:
    return False


class _Verdicts:
    """A bounded map of key -> expiry, oldest use first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._expiry: OrderedDict[bytes, float] = OrderedDict()

    def get(self, key: bytes, now: float) -> bool:
        expiry = self._expiry.get(key)
        if expiry is None:
            return False
        if expiry <= now:
            del self._expiry[key]
            return False
        return True

    def put(self, key: bytes, expiry: float) -> None:
        self._expiry[key] = expiry
        self._expiry.move_to_end(key)
        while len(self._expiry) > self.size:
            self._expiry.popitem(last=False)


class BasicAuth:
    """A WSGI application: `app` behind basic auth for `users` (name: bcrypt hash).

    `users` must not be empty (a listener without users has no BasicAuth in front).
    `checking`: requests that may hold a thread for a bcrypt round (running or waiting);
    the listener gives half its threads. `clock`: monotonic seconds (a test's stand-in)."""

    def __init__(
        self,
        users: Mapping[str, bytes],
        app: WSGIApp,
        *,
        ttl: float = CACHE_TTL,
        failure_ttl: float = FAILURE_TTL,
        cache_size: int = CACHE_SIZE,
        checking: int = 1,
        log_interval: float = LOG_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not users:
            raise ValueError("BasicAuth needs at least one user")
        self.users = dict(users)
        self.app = app
        self.ttl = ttl
        self.failure_ttl = failure_ttl
        self._clock = clock
        self.checking = max(1, checking)
        # any user's hash: an unknown name costs the same bcrypt round as a known one
        self._decoy = next(iter(self.users.values()))
        self._passed = _Verdicts(cache_size)
        self._failed = _Verdicts(FAILURE_CACHE_SIZE)
        # address: (no round before, its back-off, wrong passwords in a row)
        self._waits: OrderedDict[str, tuple[float, Backoff, int]] = OrderedDict()
        self._lock = threading.Lock()  # the state above and the counters below
        self._round = threading.Lock()  # held for a bcrypt round: one at a time
        self._rest_until = 0.0  # no round before this (after a failed one)
        self._throttle = Throttle(interval=log_interval)
        self.in_check = 0  # requests holding a thread for a round now
        self.bcrypt_rounds = 0  # rounds run
        self.gone = 0  # requests dropped before their round: the client had gone

    def check(self, user: str, password: str) -> bool:
        """Whether `password` is `user`'s (remembered, or one bcrypt round)."""
        return self.verdict(user, password) == ALLOW

    def verdict(
        self, user: str, password: str, client: str = "", gone: Callable[[], bool] = _never
    ) -> str:
        """ALLOW, or why not (WRONG, TOO_LONG, BACKING_OFF, BUSY, GONE) for `password`
        from address `client`; `gone()` says whether the client has left."""
        secret = password.encode()
        if len(secret) > BCRYPT_MAX_BYTES:
            return TOO_LONG
        hashed = self.users.get(user)
        key = hashlib.sha256(b"\0".join((user.encode(), secret, hashed or b""))).digest()
        with self._lock:
            remembered = self._remembered(key, hashed, client, self._clock())
            if remembered is not None:
                return remembered
            if self.in_check >= self.checking or self._clock() < self._rest_until:
                return BUSY
            self.in_check += 1
        try:
            with self._round:
                with self._lock:  # decided while this one waited for the round?
                    remembered = self._remembered(key, hashed, client, self._clock())
                if remembered is not None:
                    return remembered
                if gone():
                    with self._lock:
                        self.gone += 1
                    return GONE
                if self._clock() < self._rest_until:  # a round failed while this waited
                    return BUSY
                start = self._clock()
                ok = self._bcrypt(secret, hashed or self._decoy) and hashed is not None
                now = self._clock()
                if not ok:  # rest before the next round (held by the round lock)
                    self._rest_until = now + (now - start) * (1 / FAILED_SHARE - 1)
        finally:
            with self._lock:
                self.in_check -= 1
        with self._lock:
            self.bcrypt_rounds += 1
            if ok:
                self._passed.put(key, now + self.ttl)
                self._waits.pop(client, None)
                return ALLOW
            self._failed.put(key, now + self.failure_ttl)
            self._back_off(client, now)
            return WRONG

    @staticmethod
    def _bcrypt(secret: bytes, hashed: bytes) -> bool:
        import bcrypt

        try:
            return bool(bcrypt.checkpw(secret, hashed))  # releases the GIL while it runs
        except ValueError:  # a password bcrypt refuses is not the user's
            return False

    def _remembered(self, key: bytes, hashed: bytes | None, client: str, now: float) -> str | None:
        """The verdict without a round (under the lock), or None: a round is needed."""
        if hashed is not None and self._passed.get(key, now):
            self._passed.put(key, now + self.ttl)  # remembered after its last use
            return ALLOW
        if self._failed.get(key, now):
            return WRONG
        waiting = self._waits.get(client)
        if waiting is not None and waiting[0] > now:
            return BACKING_OFF
        return None

    def _back_off(self, client: str, now: float) -> None:
        if not client:
            return  # no address (a direct check): nothing to key a wait on
        fresh = (0.0, Backoff(BACKOFF_LEAST, BACKOFF_MOST), 0)
        until, backoff, strikes = self._waits.pop(client, fresh)
        if strikes and now - max(until, self._rest_until) > BACKOFF_MOST:
            backoff.reset()  # quiet long enough: start again from the least wait
            strikes = 0
        strikes += 1
        wait = backoff.next() if strikes > FREE_STRIKES else 0.0
        self._waits[client] = (now + wait, backoff, strikes)
        while len(self._waits) > BACKOFF_SIZE:
            self._waits.popitem(last=False)

    def retry_after(self, client: str) -> int:
        """Whole seconds until a round may run for `client` (at least 1)."""
        with self._lock:
            waiting = self._waits.get(client)
            until = max(self._rest_until, waiting[0] if waiting is not None else 0.0)
        return max(1, int(until - self._clock() + 0.999))

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        client = str(environ.get("REMOTE_ADDR", ""))
        credentials = credentials_of(environ.get("HTTP_AUTHORIZATION", ""))
        if credentials is None:
            why = NO_CREDENTIALS
        else:
            gone = environ.get("hostpool.client_gone", _never)
            why = self.verdict(*credentials, client=client, gone=gone)
        if why == ALLOW:
            return self.app(environ, start_response)
        self._throttle.warning(
            "hostpool.http_unauthorized",
            why,
            why=why,
            client=client,
            path=environ.get("PATH_INFO", ""),
        )
        if why in _NOT_NOW:
            status, body = _NOT_NOW[why]
            extra = ("Retry-After", str(self.retry_after(client)))
        else:
            status, body = "401 Unauthorized", _UNAUTHORIZED
            extra = ("WWW-Authenticate", f'Basic realm="{REALM}"')
        start_response(
            status,
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body))),
                extra,
            ],
        )
        return [body]


def credentials_of(header: str) -> tuple[str, str] | None:
    """(user, password) from an `Authorization: Basic ...` header value; None when it is
    absent, of another scheme, or malformed."""
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = binascii.a2b_base64(encoded.strip().encode("ascii"), strict_mode=True)
        text = decoded.decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None
    user, sep, password = text.partition(":")
    if not sep:
        return None
    return user, password
