"""HTTP endpoints of `hostpool serve`: /metrics, /debug/pools, /healthz (loopback by default)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from hostpool.metrics import register_metrics

del GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR  # the global ones stay untouched


def service_registry() -> CollectorRegistry:
    """hostpool's collector plus prometheus_client's process and platform collectors."""
    registry = CollectorRegistry()
    register_metrics(registry)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    debug: Callable[[], dict[str, Any]]
    healthy: Callable[[], bool]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path == "/debug/pools":
            body = json.dumps(self.debug(), indent=2, sort_keys=True).encode()
            self._send(200, body, "application/json")
        elif path == "/healthz":
            ok = self.healthy()
            self._send(200 if ok else 503, b"ok\n" if ok else b"stopping\n", "text/plain")
        else:
            self._send(404, b"not found: try /metrics, /debug/pools, /healthz\n", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every second would flood the log


class ServiceHTTP:
    """A threaded HTTP server on its own thread; `stop()` waits for it to finish."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        debug: Callable[[], dict[str, Any]],
        healthy: Callable[[], bool],
        registry: CollectorRegistry | None = None,
    ) -> None:
        handler = type(
            "Handler",
            (_Handler,),
            {
                "registry": registry or service_registry(),
                "debug": staticmethod(debug),
                "healthy": staticmethod(healthy),
            },
        )
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="hostpool-http", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def start(self) -> ServiceHTTP:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()
