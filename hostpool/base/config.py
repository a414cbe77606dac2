"""Loading configuration values: inline JSON, or `@path` to a .json, .toml or .yaml file.

A malformed config is a ConfigError naming the file and the problem, never a silent
default: a server that meant `"allocator": "shm"` must not quietly get another one.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hostpool.errors import ConfigError


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


def read_file(path: str, *, what: str) -> bytes:
    """The bytes of the file at `path`. Raises ConfigError naming `what` and the path
    when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it: {exc.strerror}") from None


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
            import yaml

            data = yaml.safe_load(raw)
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
