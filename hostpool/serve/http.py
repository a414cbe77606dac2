"""HTTP endpoints of `hostpool serve`: /metrics, /debug/pools, /healthz (loopback by default).

A WSGI application served by `hostpool.net.listener` (deadlines, a connection cap).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    make_wsgi_app,
)
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from hostpool.metrics.collector import register_metrics
from hostpool.net.listener import WSGIApp

del GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR  # the global ones stay untouched


def service_registry() -> CollectorRegistry:
    """hostpool's collector plus prometheus_client's process and platform collectors."""
    registry = CollectorRegistry()
    register_metrics(registry)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def service_app(
    *,
    debug: Callable[[], dict[str, Any]],
    healthy: Callable[[], bool],
    registry: CollectorRegistry | None = None,
) -> WSGIApp:
    """The three endpoints; anything else is a 404 naming them."""
    metrics = make_wsgi_app(registry or service_registry())

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if path == "/debug/pools":
            body = json.dumps(debug(), indent=2, sort_keys=True).encode()
            return _send(start_response, "200 OK", body, "application/json")
        if path == "/healthz":
            if healthy():
                return _send(start_response, "200 OK", b"ok\n", "text/plain")
            return _send(start_response, "503 Service Unavailable", b"stopping\n", "text/plain")
        body = b"not found: try /metrics, /debug/pools, /healthz\n"
        return _send(start_response, "404 Not Found", body, "text/plain")

    return app


def _send(
    start_response: Callable[..., Any], status: str, body: bytes, content_type: str
) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]
