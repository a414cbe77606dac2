"""HTTP basic auth in front of a WSGI application, against bcrypt hashes.

`BasicAuth(users, app)` answers a request without credentials, or with a user or password
that does not match, with 401 and `WWW-Authenticate: Basic realm="hostpool"`; the
application never runs for it. A password is checked with `bcrypt.checkpw` (constant
time); an unknown user costs one bcrypt round too, so timing does not tell which users
exist. A successful (user, password) is remembered for `ttl` seconds, keyed by a SHA-256
of the pair and the user's hash, so a scrape every 15 s costs one bcrypt round a minute,
not one a scrape (node_exporter caches the same way); failures are never remembered.
"""

from __future__ import annotations

import binascii
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hostpool.net.guard import Throttle
from hostpool.net.wsgi import WSGIApp

REALM = "hostpool"
CACHE_TTL = 60.0  # seconds a successful check is remembered
CACHE_SIZE = 256  # (user, password) pairs remembered at most
_UNAUTHORIZED = b"unauthorized: this endpoint needs basic auth (see the web config file)\n"


class BasicAuth:
    """A WSGI application: `app` behind basic auth for `users` (name: bcrypt hash).

    `users` must not be empty (a listener without users has no BasicAuth in front)."""

    def __init__(
        self,
        users: Mapping[str, bytes],
        app: WSGIApp,
        *,
        ttl: float = CACHE_TTL,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        if not users:
            raise ValueError("BasicAuth needs at least one user")
        self.users = dict(users)
        self.app = app
        self.ttl = ttl
        self.cache_size = cache_size
        # any user's hash: an unknown name costs the same bcrypt round as a known one
        self._decoy = next(iter(self.users.values()))
        self._passed: dict[bytes, float] = {}  # digest of (user, password, hash): expiry
        self._lock = threading.Lock()
        self._throttle = Throttle(interval=10.0)
        self.bcrypt_rounds = 0  # checks that ran bcrypt (the cache missed)

    def check(self, user: str, password: str) -> bool:
        """Whether `password` is `user`'s."""
        import bcrypt

        hashed = self.users.get(user)
        key = hashlib.sha256(b"\0".join((user.encode(), password.encode(), hashed or b""))).digest()
        now = time.monotonic()
        if hashed is not None:
            with self._lock:
                expiry = self._passed.get(key)
                if expiry is not None and expiry > now:
                    return True
        ok = bcrypt.checkpw(password.encode(), hashed or self._decoy) and hashed is not None
        with self._lock:
            self.bcrypt_rounds += 1
            if ok:
                self._remember(key, now)
        return ok

    def _remember(self, key: bytes, now: float) -> None:
        if len(self._passed) >= self.cache_size:
            for stale in [k for k, expiry in self._passed.items() if expiry <= now]:
                del self._passed[stale]
            while len(self._passed) >= self.cache_size:
                del self._passed[next(iter(self._passed))]  # the oldest entry
        self._passed[key] = now + self.ttl

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        credentials = credentials_of(environ.get("HTTP_AUTHORIZATION", ""))
        if credentials is not None and self.check(*credentials):
            return self.app(environ, start_response)
        self._throttle.warning(
            "hostpool.http_unauthorized",
            None,
            path=environ.get("PATH_INFO", ""),
            why="no credentials" if credentials is None else "wrong user or password",
        )
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(_UNAUTHORIZED))),
                ("WWW-Authenticate", f'Basic realm="{REALM}"'),
            ],
        )
        return [_UNAUTHORIZED]


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
