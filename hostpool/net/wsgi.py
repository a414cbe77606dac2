"""The WSGI application type that the listener serves and the apps in front of it wrap."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

# environ, start_response -> body chunks
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
