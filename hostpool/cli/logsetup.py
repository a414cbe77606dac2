"""Log rendering for the CLI only: console or JSON lines (auto: console on a TTY), to stderr.

The library never configures logging; only the `hostpool` command does, here. Only the
`hostpool` logger (and waitress, the HTTP listener) get the handler: other libraries'
chatter, such as torch's FakeTensor cache stats at exit, stays out of hostpool's log.
A status line (populate progress on a TTY) is cleared before each log line and redrawn
after it, so the two never tear.

The console renderer shows fields for people (`for_people`); JSON lines keep the raw
values (byte counts as ints, seconds as floats, lists as lists) for tools.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import structlog

from hostpool.base.units import format_size

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "console", "json")
LOGGERS = ("hostpool", "waitress")


class StatusLine(Protocol):
    @property
    def lock(self) -> object: ...

    def clear(self) -> None: ...

    def redraw(self) -> None: ...


_status: StatusLine | None = None

# Fields that hold byte counts besides `bytes` and names ending in `_bytes`.
BYTE_FIELDS = frozenset({"size", "page_size", "done", "total"})
# Fields that hold seconds besides `seconds` and names ending in `_seconds` or `_s`.
SECOND_FIELDS = frozenset({"seconds"})


def is_byte_field(key: str) -> bool:
    """Whether field `key` holds a byte count: `bytes`, `*_bytes`, or one of BYTE_FIELDS."""
    return key == "bytes" or key.endswith("_bytes") or key in BYTE_FIELDS


def is_rate_field(key: str) -> bool:
    """Whether field `key` holds bytes per second: names ending in `_bytes_per_s`."""
    return key.endswith("_bytes_per_s")


def is_seconds_field(key: str) -> bool:
    """Whether field `key` holds seconds: `seconds`, `*_seconds`, or `*_s` (not a rate)."""
    if is_rate_field(key):
        return False
    return key in SECOND_FIELDS or key.endswith(("_seconds", "_s"))


def format_seconds(value: float) -> str:
    """Seconds for people: `850us`, `12.3ms`, `1.25s`, `42s`, `3m07s`, `2h05m`."""
    if value == 0:
        return "0s"
    if value < 0.001:
        return f"{value * 1e6:.0f}us"
    if value < 1:
        return f"{value * 1e3:.1f}ms"
    if value < 10:
        return f"{value:.2f}s"
    if value < 60:
        return f"{value:.0f}s"
    minutes, secs = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _plain(value: object) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{k}:{_plain(v)}" for k, v in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(_plain(v) for v in value)
    return str(value)


def for_people(key: str, value: object) -> object:
    """One field as the console shows it (None: leave the field out, as for None and
    empty lists or dicts).

    Byte fields (`is_byte_field`, int values) as sizes (`64MiB`), rates as `512MiB/s`,
    seconds (`is_seconds_field`, int or float) as `format_seconds`, fields named
    `address` or `*_address` (ints) in hex, lists, tuples, sets and dicts as
    comma-joined plain text (`kv,swa`, `explicit:3,tensor:1`); anything else unchanged."""
    if value is None:
        return None
    if isinstance(value, Mapping | list | tuple | set | frozenset) and not value:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        if isinstance(value, int) and is_byte_field(key):
            return format_size(value)
        if is_rate_field(key):
            return format_size(int(value)) + "/s"
        if is_seconds_field(key):
            return format_seconds(float(value))
    address = key == "address" or key.endswith("_address")
    if address and isinstance(value, int) and not isinstance(value, bool):
        return hex(value)
    if isinstance(value, Mapping | list | tuple | set | frozenset):
        return _plain(value)
    return value


_SKIP = frozenset({"event", "level", "log_level", "timestamp", "logger", "exc_info"})


def render_for_people(_logger: object, _method: str, event_dict: Any) -> Any:
    """structlog processor for the console: every field through `for_people`, None
    fields left out; the event name, level and timestamp untouched."""
    out: dict[str, Any] = {}
    for key, value in event_dict.items():
        if key in _SKIP or key.startswith("_"):
            out[key] = value
            continue
        shown = for_people(key, value)
        if shown is not None:
            out[key] = shown
    return out


def set_status_line(status: StatusLine | None) -> None:
    global _status
    _status = status


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    def emit(self, record: logging.LogRecord) -> None:
        status = _status
        if status is None:
            super().emit(record)
            return
        with status.lock:  # type: ignore[attr-defined]
            status.clear()
            super().emit(record)
            status.redraw()


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Send the `hostpool` and waitress loggers to stderr at `level`, rendered as
    console text for people or JSON lines (`fmt`: auto, console or json)."""
    renderer: structlog.types.Processor
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    processors: list[structlog.types.Processor] = [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta
    ]
    if console:
        processors.append(render_for_people)
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    else:
        renderer = structlog.processors.JSONRenderer()
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[*processors, renderer],
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
        ],
    )
    handler = _Handler(sys.stderr)
    handler.setFormatter(formatter)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    structlog.configure(
        processors=[
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
