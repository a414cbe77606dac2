"""`HostPoolManager`: the public manager, the core's `PoolManager` plus `register_metrics()`.

It lives at the package face because metrics are presentation, a floor above the core's
ledger and allocators: the core never imports them, this module imports both.
"""

from __future__ import annotations

from typing import Any

from hostpool.core.manager import PoolManager
from hostpool.metrics.collector import register_metrics


class HostPoolManager(PoolManager):
    """One allocator per pool, a budget, snapshots, metrics and close: see `PoolManager`."""

    def register_metrics(self, registry: Any = None) -> Any:
        """Register hostpool's collector for this manager's ledger with `registry`
        (default: prometheus_client's global one); idempotent per registry. Returns the
        registry's collector."""
        return register_metrics(registry, ledger=self.ledger)
