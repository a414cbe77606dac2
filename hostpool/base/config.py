"""Loading configuration values: inline JSON, or `@path` to a .json, .toml or .yaml file.

A malformed config is a ConfigError naming the file and the problem, never a silent
default: a server that meant `"allocator": "shm"` must not quietly get another one.

A config file is opened without blocking and must be a regular file of at most
MAX_FILE_BYTES (a FIFO, /dev/zero or a directory is one line, never a hang or a read
without end); YAML is read without aliases and at most MAX_YAML_DEPTH levels deep (a
"billion laughs" or a deeply nested file is one line, never a traceback).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from typing import Any, TypedDict, Unpack, cast

from hostpool.errors import ConfigError

MAX_FILE_BYTES = 1 << 20  # a config file, a certificate chain or a CA bundle: far less
MAX_YAML_DEPTH = 32  # mappings and lists inside each other
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def load_mapping(value: object, *, what: str = "config") -> dict[str, Any]:
    """A dict from a dict, inline JSON text, or `@path` (.json/.toml/.yaml/.yml)."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"{what} must be a JSON string, '@path' or a dict, got {type(value).__name__}"
        )
    text = value.strip()
    if text.startswith("@"):
        return load_file(text[1:], what=what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON ({exc}): {text[:80]!r}") from exc
    return _require_mapping(data, what)


class FileRules(TypedDict, total=False):
    """What a file must be besides regular: at most `limit` bytes (MAX_FILE_BYTES), and
    whatever `check` (given its fstat) says is wrong with it (None: nothing)."""

    limit: int
    check: Callable[[os.stat_result], str | None] | None


def open_regular(path: str, *, what: str, **rules: Unpack[FileRules]) -> int:
    """An fd of the regular file at `path`, opened with O_NONBLOCK (a FIFO or a device
    never holds the caller); the caller closes it. Raises ConfigError naming `what` and
    the path when it cannot be opened, is not a regular file, is over `limit` bytes, or
    `check` (given its fstat) returns what is wrong with it."""
    limit, check = rules.get("limit", MAX_FILE_BYTES), rules.get("check")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file: it is {kind}")
        if st.st_size > limit:
            raise ConfigError(
                f"{what} {path} is {st.st_size} bytes: more than the {limit} it may have"
            )
        wrong = check(st) if check is not None else None
        if wrong is not None:
            raise ConfigError(f"{what} {path} {wrong}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: str, *, what: str, **rules: Unpack[FileRules]) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` (see `open_regular`).
    Raises ConfigError naming `what` and the path when it cannot be read."""
    fd = open_regular(path, what=what, **rules)
    limit = rules.get("limit", MAX_FILE_BYTES)
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := os.read(fd, limit + 1 - size):  # it may grow after fstat
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ConfigError(f"{what} {path} is more than the {limit} bytes it may have")
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it: {exc.strerror}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


_loader: Any = None


def load_yaml(raw: bytes) -> Any:
    """The data of one YAML document, as `yaml.safe_load` builds it, refusing aliases
    (`*name`: what a "billion laughs" is made of) and nesting deeper than MAX_YAML_DEPTH.
    Raises yaml.YAMLError."""
    global _loader
    import yaml

    if _loader is None:

        class Loader(yaml.SafeLoader):
            depth = 0

            def compose_node(self, parent: Any, index: Any) -> Any:
                event: Any = cast(Any, self).peek_event()  # its stubs leave it untyped
                mark = event.start_mark
                if isinstance(event, yaml.AliasEvent):
                    raise yaml.composer.ComposerError(
                        None, None, "aliases (*name) are not allowed here", mark
                    )
                if self.depth >= MAX_YAML_DEPTH:
                    raise yaml.composer.ComposerError(
                        None, None, f"nested deeper than {MAX_YAML_DEPTH}", mark
                    )
                self.depth += 1
                try:
                    return super().compose_node(parent, index)
                finally:
                    self.depth -= 1

        _loader = Loader
    loader = _loader(raw)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_file(path: str, *, what: str = "config") -> dict[str, Any]:
    """The mapping in the JSON, TOML or YAML file at `path` (by its extension). Raises
    ConfigError naming `what` and the path when it cannot be read, is malformed or is
    not a mapping."""
    ext = os.path.splitext(path)[1].lower()
    raw = read_file(path, what=what)
    try:
        if ext == ".json":
            data = json.loads(raw)
        elif ext == ".toml":
            import tomllib  # slow to import (regex compiling): only for .toml files

            data = tomllib.loads(raw.decode())
        elif ext in (".yaml", ".yml"):
            data = load_yaml(raw)
        else:
            raise ConfigError(f"{what}: {path} must end in .json, .toml, .yaml or .yml")
    except ConfigError:
        raise
    except Exception as exc:  # each parser has its own error types; all mean "malformed"
        raise ConfigError(f"{what}: {path} is malformed: {exc}") from exc
    return _require_mapping(data, f"{what} ({path})")


def _require_mapping(data: object, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be an object/mapping, got {type(data).__name__}")
    return data
