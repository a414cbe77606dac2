"""Public path of the multiprocess publisher, which lives in `hostpool.metrics.multiprocess`."""

from hostpool.metrics.multiprocess import (
    DEFAULT_INTERVAL,
    MultiprocessPublisher,
    current_publisher,
    ensure_publisher,
)

__all__ = ["DEFAULT_INTERVAL", "MultiprocessPublisher", "current_publisher", "ensure_publisher"]
