"""HTTP endpoints of `hostpool serve` (loopback by default), served from the start of
populate: /metrics, /debug/pools, /healthz (liveness), /readyz (readiness), and a landing
page at `/` listing them (`hostpool.net.routes`, as the exporter has).

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
from hostpool.net.routes import Route, routed_app, send
from hostpool.net.wsgi import WSGIApp
from hostpool.serve.progress_metrics import PopulateCollector, PopulateState

del GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR  # the global ones stay untouched

TEXT = "text/plain; charset=utf-8"
UNAVAILABLE = "503 Service Unavailable"


def service_registry(state: PopulateState | None = None) -> CollectorRegistry:
    """hostpool's collector, prometheus_client's process and platform collectors, and with
    `state` the populate progress (`hostpool_serve_*`)."""
    registry = CollectorRegistry()
    register_metrics(registry)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    if state is not None:
        registry.register(PopulateCollector(state))
    return registry


def service_app(
    *,
    debug: Callable[[], dict[str, Any]],
    healthy: Callable[[], bool],
    readiness: Callable[[], tuple[bool, str]],
    registry: CollectorRegistry | None = None,
) -> WSGIApp:
    """The endpoints; `/` lists them and anything else is a 404 naming them.

    `healthy()`: /healthz answers 200 `ok` while it is true, else 503 `stopping`.
    `readiness()`: (ready, line); /readyz answers 200 with the line when ready, else 503.
    `debug()`: the JSON document of /debug/pools (called on an HTTP worker thread).
    """
    metrics = make_wsgi_app(registry or service_registry())

    def debug_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = json.dumps(debug(), indent=2, sort_keys=True).encode()
        return send(start_response, "200 OK", body, "application/json")

    def healthz(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if healthy():
            return send(start_response, "200 OK", b"ok\n", TEXT)
        return send(start_response, UNAVAILABLE, b"stopping\n", TEXT)

    def readyz(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        ready, line = readiness()
        status = "200 OK" if ready else UNAVAILABLE
        return send(start_response, status, f"{line}\n".encode(), TEXT)

    return routed_app(
        "hostpool serve",
        [
            Route("/metrics", "Prometheus metrics of the pools and this process", metrics),
            Route("/debug/pools", "every pool and region as JSON", debug_app),
            Route("/healthz", "liveness: 200 while running, 503 once stopping", healthz),
            Route(
                "/readyz",
                "readiness: 200 once every pool is populated, 503 while populating "
                "(saying what) or stopping",
                readyz,
            ),
        ],
    )
