"""The broker: pools that outlive the engine (`hostpool serve` lends them; see
docs/broker.md). Names load lazily: the client is torch-free, the server is not."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hostpool._lazy import lazy_exports

__all__ = ["Broker", "Lease", "lease"]
_EXPORTS = {
    "Lease": "hostpool.broker.client",
    "lease": "hostpool.broker.client",
    "Broker": "hostpool.broker.server",
}

if TYPE_CHECKING:
    from hostpool.broker.client import Lease, lease
    from hostpool.broker.server import Broker

__getattr__, __dir__ = lazy_exports("hostpool.broker", _EXPORTS, globals())
