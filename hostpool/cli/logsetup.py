"""Log rendering for the CLI only: console or JSON lines (auto: console on a TTY), to stderr.

The library never configures logging; only the `hostpool` command does, here. Only the
`hostpool` logger (and waitress, the HTTP listener) get the handler: other libraries'
chatter, such as torch's FakeTensor cache stats at exit, stays out of hostpool's log.
A status line (populate progress on a TTY) is cleared before each log line and redrawn
after it, so the two never tear.
"""

from __future__ import annotations

import logging
import sys
from typing import Protocol

import structlog

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "console", "json")
LOGGERS = ("hostpool", "waitress")


class StatusLine(Protocol):
    @property
    def lock(self) -> object: ...

    def clear(self) -> None: ...

    def redraw(self) -> None: ...


_status: StatusLine | None = None


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
    renderer: structlog.types.Processor
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    if console:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    else:
        renderer = structlog.processors.JSONRenderer()
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            renderer,
        ],
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
