"""The broker: pools that outlive the engine (`hostpool serve` lends them; see
docs/broker.md). Torch-free: the lease client and the server import no tensor library."""

from __future__ import annotations

from hostpool.broker.client import Lease, lease
from hostpool.broker.server import Broker

__all__ = ["Broker", "Lease", "lease"]
