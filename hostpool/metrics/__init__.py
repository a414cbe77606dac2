"""Presentation: the process's pools as Prometheus metrics, collected from the ledger at
scrape time (`collector`), published to prometheus_client's multiprocess directory for
servers that serve `/metrics` from it (`multiprocess`), and other processes' pools read
from /proc (`exporter`)."""

from hostpool.metrics.collector import (
    METRICS,
    HostPoolCollector,
    count_publish_error,
    measure,
    publish_errors,
    register_metrics,
)

__all__ = [
    "METRICS",
    "HostPoolCollector",
    "count_publish_error",
    "measure",
    "publish_errors",
    "register_metrics",
]
