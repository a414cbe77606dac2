"""The web config file of hostpool's HTTP listeners: TLS and basic auth, node_exporter's format.

`load(path)` reads a YAML file of the shape node_exporter's `--web.config.file` takes:

    tls_server_config:
      cert_file: server.crt          # PEM certificate (chain), the server's first
      key_file: server.key           # its PEM private key, unencrypted
      client_auth_type: RequireAndVerifyClientCert   # NoClientCert (default),
                                     # VerifyClientCertIfGiven, RequireAndVerifyClientCert
      client_ca_file: ca.crt         # the CAs client certificates are verified against
      min_version: TLS12             # TLS10, TLS11, TLS12 (default), TLS13
      max_version: TLS13             # optional
    basic_auth_users:
      alice: $2y$10$...              # bcrypt hash of alice's password

Relative paths are resolved against the directory of the config file. Everything is
checked when it is loaded: a key hostpool does not know, a missing certificate or key, a
file that cannot be read or is not what its key says, a hash that is not bcrypt's, an
unknown `client_auth_type` or version is a ConfigError naming the key and the file. An
empty file means plain HTTP without auth, as node_exporter has it.

Each file is opened without blocking and must be a regular file of bounded size (a FIFO
or /dev/zero is a ConfigError, never a hang; `hostpool.base.config.open_regular`); the
config must not be writable by others (anyone could add a user or a CA), nor the
certificate files; the private key must not be readable by others either. TLS loads the
very files checked (through /proc/self/fd), not whatever their paths name a moment
later. The YAML may not hold aliases (a "billion laughs") or nest deeper than 32.

`RequestClientCert` and `RequireAnyClientCert` (a client certificate asked for but never
verified) are refused: Python's ssl module cannot ask for a certificate without
verifying it. The inline `cert`/`key`, `cipher_suites`, `curve_preferences`,
`client_allowed_sans` and `http_server_config` are refused as unsupported, never ignored.
"""

from __future__ import annotations

import contextlib
import os
import re
import ssl
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hostpool.base.config import load_yaml, open_regular, read_file
from hostpool.errors import ConfigError

CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
DEFAULT_MIN_VERSION = "TLS12"  # node_exporter's default

_TOP_KEYS = {"tls_server_config", "basic_auth_users"}
_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "min_version",
    "max_version",
}
# node_exporter's keys hostpool does not implement: refused by name, never ignored
_UNSUPPORTED = {
    "http_server_config": "HTTP/2 and extra headers are not served",
    "cert": "give the certificate as cert_file",
    "key": "give the key as key_file",
    "cipher_suites": "OpenSSL's defaults for the TLS versions allowed are used",
    "curve_preferences": "OpenSSL's defaults are used",
    "prefer_server_cipher_suites": "OpenSSL's defaults are used",
    "client_allowed_sans": "any certificate client_ca_file verifies is accepted",
}
_UNVERIFIED_AUTH = ("RequestClientCert", "RequireAnyClientCert")
# $2a$, $2b$ or $2y$, a two-digit cost, 22 characters of salt and 31 of hash
_BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
MAX_BYTES = 256 << 10  # the web config itself: thousands of users fit; parsing stays short


def _not_writable(st: os.stat_result) -> str | None:
    """What is wrong with a file of the config that others may write (None: nothing)."""
    if st.st_mode & stat.S_IWOTH:
        return (
            f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): anyone could "
            "change what it says; chmod o-w it"
        )
    return None


def _private(st: os.stat_result) -> str | None:
    """What is wrong with a private key file that others may read or write."""
    if st.st_mode & stat.S_IROTH:
        return (
            f"is readable by others (mode {stat.S_IMODE(st.st_mode):04o}): a private key "
            "must not be; chmod o-rw it"
        )
    return _not_writable(st)


@dataclass(frozen=True)
class _Opened:
    """A file of the config, checked and held open."""

    path: str  # as the config names it, made absolute
    fd: int

    @property
    def load(self) -> str:
        """The path TLS loads it by: the file checked, whatever `path` names by then."""
        return f"/proc/self/fd/{self.fd}"


@dataclass(frozen=True, eq=False)
class WebConfig:
    """A loaded web config: `tls` the server's context (None: plain HTTP) and `users`
    (name: bcrypt hash; empty: no auth)."""

    path: str
    tls: ssl.SSLContext | None = None
    client_auth: str = "NoClientCert"
    users: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        """The URL scheme the listener serves: https with TLS, else http."""
        return "http" if self.tls is None else "https"

    def describe(self) -> str:
        """One phrase for a log or `--check` line, e.g. `TLS (RequireAndVerifyClientCert),
        basic auth (2 users)`."""
        parts = ["plain HTTP" if self.tls is None else f"TLS ({self.client_auth})"]
        if self.users:
            parts.append(f"basic auth ({len(self.users)} user{'s' if len(self.users) > 1 else ''})")
        return ", ".join(parts)


def load(path: str) -> WebConfig:
    """The web config in the YAML file at `path`, checked whole.

    Raises ConfigError, naming the file and the key, when the file cannot be read, is not
    YAML, or holds a key, value, path or hash that is wrong (see the module's doc)."""
    import yaml

    raw = read_file(path, what="web config", limit=MAX_BYTES, check=_not_writable)
    try:
        data = load_yaml(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"web config {path}: not YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return WebConfig(path)
    table = _mapping(data, path, "the file")
    _known(table, _TOP_KEYS, path, "")
    base = os.path.dirname(os.path.abspath(path))
    tls = table.get("tls_server_config")
    if tls is None:
        context, auth = None, "NoClientCert"
    else:
        with contextlib.ExitStack() as files:  # the files stay open until TLS loaded them
            context, auth = _tls(tls, path, base, files)
    users = _users(table.get("basic_auth_users"), path)
    return WebConfig(path, context, auth, users)


def _mapping(value: object, path: str, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"web config {path}: {key} must be a mapping, got {_kind(value)}")
    return value


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


def _known(table: dict[str, Any], known: set[str], path: str, prefix: str) -> None:
    for key in table:
        name = f"{prefix}{key}"
        if key in _UNSUPPORTED:
            raise ConfigError(f"web config {path}: {name} is not supported: {_UNSUPPORTED[key]}")
        if key not in known:
            raise ConfigError(
                f"web config {path}: unknown key {name!r}; known: "
                + ", ".join(f"{prefix}{k}" for k in sorted(known))
            )


def _text(table: dict[str, Any], key: str, path: str, prefix: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"web config {path}: {prefix}{key} must be a non-empty string")
    return value


def _choice(table: dict[str, Any], key: str, choices: Mapping[str, Any], path: str) -> str | None:
    value = _text(table, key, path, "tls_server_config.")
    if value is not None and value not in choices:
        raise ConfigError(
            f"web config {path}: tls_server_config.{key} {value!r} is not one of "
            + ", ".join(choices)
        )
    return value


def _file(
    table: dict[str, Any], key: str, path: str, base: str, files: contextlib.ExitStack
) -> _Opened | None:
    """The file under `key`, opened (closed with `files`) once it is known to be a regular
    file, small enough, and not open to others."""
    value = _text(table, key, path, "tls_server_config.")
    if value is None:
        return None
    full = os.path.join(base, os.path.expanduser(value))
    check = _private if key == "key_file" else _not_writable
    fd = open_regular(full, what=f"web config {path}: tls_server_config.{key}", check=check)
    files.callback(os.close, fd)
    return _Opened(full, fd)


def _tls(
    value: object, path: str, base: str, files: contextlib.ExitStack
) -> tuple[ssl.SSLContext, str]:
    table = _mapping(value, path, "tls_server_config")
    _known(table, _TLS_KEYS, path, "tls_server_config.")
    for name in ("cert_file", "key_file"):
        if table.get(name) is None:
            raise ConfigError(f"web config {path}: tls_server_config.{name} is required")
    cert = _file(table, "cert_file", path, base, files)
    key = _file(table, "key_file", path, base, files)
    client_ca = _file(table, "client_ca_file", path, base, files)
    raw_auth = table.get("client_auth_type")
    if raw_auth in _UNVERIFIED_AUTH:
        raise ConfigError(
            f"web config {path}: tls_server_config.client_auth_type {raw_auth} is not "
            "supported (Python's ssl cannot ask for a client certificate without verifying "
            "it): use VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file"
        )
    auth = _choice(table, "client_auth_type", CLIENT_AUTH_TYPES, path) or "NoClientCert"
    low = _choice(table, "min_version", TLS_VERSIONS, path) or DEFAULT_MIN_VERSION
    high = _choice(table, "max_version", TLS_VERSIONS, path)
    if high is not None and TLS_VERSIONS[high] < TLS_VERSIONS[low]:
        raise ConfigError(
            f"web config {path}: tls_server_config.max_version {high} is below min_version {low}"
        )
    if auth == "NoClientCert" and client_ca is not None:
        raise ConfigError(
            f"web config {path}: tls_server_config.client_ca_file is set but client_auth_type "
            "is NoClientCert: no client certificate would be checked (set client_auth_type)"
        )
    if auth != "NoClientCert" and client_ca is None:
        raise ConfigError(
            f"web config {path}: tls_server_config.client_auth_type {auth} needs client_ca_file "
            "(the CAs client certificates are verified against)"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.options |= ssl.OP_NO_RENEGOTIATION  # no TLS 1.2 renegotiation mid-connection
    try:
        context.minimum_version = TLS_VERSIONS[low]
        if high is not None:
            context.maximum_version = TLS_VERSIONS[high]
    except (ValueError, ssl.SSLError) as exc:
        raise ConfigError(
            f"web config {path}: tls_server_config.min_version/max_version: this OpenSSL "
            f"refuses {low}..{high or 'newest'}: {exc}"
        ) from None
    assert cert is not None and key is not None
    _pem_certificates(cert, "cert_file", path)
    try:
        # b"" for a passphrase: an encrypted key fails here instead of prompting on a tty
        context.load_cert_chain(cert.load, key.load, password=b"")
    except ssl.SSLError as exc:
        raise ConfigError(
            f"web config {path}: tls_server_config.key_file {key.path} is not an unencrypted "
            f"PEM private key matching cert_file {cert.path} ({exc.reason or exc})"
        ) from None
    if client_ca is not None:
        _pem_certificates(client_ca, "client_ca_file", path)
        context.load_verify_locations(cafile=client_ca.load)
    context.verify_mode = CLIENT_AUTH_TYPES[auth]
    return context, auth


def _pem_certificates(file: _Opened, key: str, path: str) -> None:
    """Raise a ConfigError naming `key` unless `file` holds PEM certificates."""
    scratch = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        scratch.load_verify_locations(cafile=file.load)
    except (ssl.SSLError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ConfigError(
            f"web config {path}: tls_server_config.{key} {file.path} holds no PEM certificate "
            f"({reason})"
        ) from None


def _users(value: object, path: str) -> dict[str, bytes]:
    if value is None:
        return {}
    table = _mapping(value, path, "basic_auth_users")
    users: dict[str, bytes] = {}
    for name, hashed in table.items():
        where = f"web config {path}: basic_auth_users.{name}"
        if not isinstance(name, str) or not name or ":" in name:
            raise ConfigError(
                f"web config {path}: basic_auth_users: user name {name!r} must be a "
                "non-empty string without ':' (basic auth cannot send one)"
            )
        match = _BCRYPT.fullmatch(hashed) if isinstance(hashed, str) else None
        if match is None:
            raise ConfigError(
                f"{where} is not a bcrypt hash ($2y$10$ and 53 characters); make one with "
                "python -c \"import bcrypt; print(bcrypt.hashpw(b'PASSWORD', "
                'bcrypt.gensalt()).decode())"'
            )
        if not 4 <= int(match.group(1)) <= 31:
            raise ConfigError(f"{where}: bcrypt's cost must be 04..31, got {match.group(1)}")
        users[name] = hashed.encode()
    return users
