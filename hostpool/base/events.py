"""Structured events on the stdlib logger `hostpool`.

The library never configures logging. Events go through structlog wrapped around
`logging.getLogger("hostpool")` without explicit processors, so an application that
configures nothing sees only warnings on stderr (the stdlib's last-resort handler), one
that configures stdlib logging or structlog gets structured events, and
`structlog.testing.capture_logs` sees them (with the `hostpool` logger's level lowered).
Every event is guarded by the stdlib level check: rendering one costs time on the
allocation path even when nothing prints it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from hostpool.base import fork

stdlib_logger = logging.getLogger("hostpool")
_log: Any = None


def _structlog() -> Any:
    """structlog, wrapped around the stdlib logger at the first event that passes the level
    check: importing it is slow (it pulls in rich where rich is installed), which a
    process that logs nothing should not pay on its first allocation."""
    global _log
    if _log is None:
        import structlog

        _log = structlog.wrap_logger(stdlib_logger)
    return _log


def _before_fork() -> None:
    # A child forked while another thread is inside `import structlog` would wait for
    # that import's module lock forever: let the import finish first (no cost otherwise).
    if _log is None and "structlog" in sys.modules:
        _structlog()


fork.on_fork(__name__, before=_before_fork)


def emit(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Emit `event` (a dotted name such as `hostpool.alloc`) with key-value fields."""
    if stdlib_logger.isEnabledFor(level):
        try:
            log = _structlog()
        except OSError:  # importing needs fds: at RLIMIT_NOFILE, say it the plain way
            stdlib_logger.log(level, "%s %s", event, fields)
            return
        log.log(level, event, **fields)


def debug(event: str, **fields: Any) -> None:
    emit(event, logging.DEBUG, **fields)


def info(event: str, **fields: Any) -> None:
    emit(event, logging.INFO, **fields)


def warning(event: str, **fields: Any) -> None:
    emit(event, logging.WARNING, **fields)


def error(event: str, **fields: Any) -> None:
    """An event after which the process (or the operation it names) cannot go on."""
    emit(event, logging.ERROR, **fields)
