"""A WSGI application of a few fixed paths, with a landing page, as node_exporter has.

`routed_app(title, routes)` answers each route's path with its application, `/` with a
small HTML page linking every route and saying what it is, and any other path with a
404 (text/plain) naming the routes. Paths match exactly: `/metrics/` and `/metricsx` are
not `/metrics`. Nothing here reads a request body.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hostpool.net.wsgi import WSGIApp


@dataclass(frozen=True)
class Route:
    """One endpoint: its exact path, a one-line description, and what answers it."""

    path: str
    description: str
    app: WSGIApp


def text_app(body: str, status: str = "200 OK") -> WSGIApp:
    """An application answering every request with `body` as text/plain."""
    data = body.encode()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        return send(start_response, status, data, "text/plain; charset=utf-8")

    return app


def routed_app(title: str, routes: Sequence[Route]) -> WSGIApp:
    """`routes` by exact path, a landing page at `/` listing them, 404 elsewhere."""
    by_path = {route.path: route.app for route in routes}
    if "/" in by_path or len(by_path) != len(routes):
        raise ValueError("routes need distinct paths other than /")
    items = "".join(
        f'<li><a href="{html.escape(r.path)}">{html.escape(r.path)}</a>: '
        f"{html.escape(r.description)}</li>\n"
        for r in routes
    )
    landing = (
        f"<!DOCTYPE html>\n<html><head><title>{html.escape(title)}</title></head>\n"
        f"<body><h1>{html.escape(title)}</h1>\n<ul>\n{items}</ul></body></html>\n"
    ).encode()
    missing = f"not found: try {', '.join(r.path for r in routes)}\n".encode()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        target = by_path.get(path)
        if target is not None:
            return target(environ, start_response)
        if path == "/":
            return send(start_response, "200 OK", landing, "text/html; charset=utf-8")
        return send(start_response, "404 Not Found", missing, "text/plain; charset=utf-8")

    return app


def send(
    start_response: Callable[..., Any], status: str, body: bytes, content_type: str
) -> list[bytes]:
    """Start a response with `body` and its length; the body as WSGI wants it."""
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]
