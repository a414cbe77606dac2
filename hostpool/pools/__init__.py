"""Former home of the host-wide budget, now `hostpool.integrations.hostbudget` (layer 5):
`hostpool.pools.hostbudget` is the same module object, so existing imports keep working."""

from __future__ import annotations

import sys

from hostpool.integrations import hostbudget

sys.modules[f"{__name__}.hostbudget"] = hostbudget
HostBudget = hostbudget.HostBudget

__all__ = ["HostBudget"]
